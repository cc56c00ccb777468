"""A Python repository's test environment, prepared once: a venv that lives inside the snapshot.

The venv sits at `.venv` in the repository's tree, so inside every sandbox over the snapshot it is
`/workspace/.venv` and `/workspace/.venv/bin/python -m pytest` runs the suite. It is made with the host's
interpreter, which sandboxes bind at its own path, so its `bin/python` link resolves inside.

What goes in:
- the project's dependencies (`[project].dependencies`, the optional groups and dependency groups named test,
  tests, testing or dev), the test requirement files many projects keep instead (`requirements-test.txt`,
  `requirements/tests.txt`, …, following `-r`; tox's `[testenv] deps`), requirements the user names
  (`shipyard synth --with PKG`), pytest and coverage (per-test coverage is how features are mapped to tests), and
  the project's build backend (for the editable install);
- a requirement already satisfied by a distribution installed on the host is copied file by file from the
  host's site-packages (its `RECORD`; offline, milliseconds), and its console scripts (`pytest`, `pip`) are written
  anew to run the venv's interpreter (the host's run the host's); the rest is fetched on the host without running any
  of it (`shipyard.tasks.downloads`: wheels by `pip download --only-binary=:all:`, a requirement published only as
  an sdist as the archive itself, its dependencies and build requirements read statically) and installed inside a
  sandbox with `--no-index` (and no build isolation: the sandbox has no network to fetch build requirements), so
  every package build — an sdist's metadata hook included — runs sandboxed; the sdists' build requirements are
  installed first;
- the project itself, editable (`pip install -e /workspace` inside a sandbox, no network): a path pointer, never
  a copy of its code in site-packages — a copy would hand the deleted code back to the agent.

The repository is untrusted input, and so is everything its build scripts write:
- **The copy never follows a link out of the repo** (`copy_repository`): one walk that `lstat`s every entry and
  copies regular files and directories only. A symbolic link whose target resolves inside the repo to a regular
  file becomes a copy of that file (fixtures are often linked); every other link — out of the repo, dangling, to a
  directory, into `.git`, a loop — and every special file (FIFO, socket, device) is left out and reported
  (`Prepared.skipped`). `.git`, `.venv` and `__pycache__` are not copied. After the copy the tree holds no link
  outside its venv, and nothing downstream follows one (`regular_files` lists by `lstat`).
- **Nothing from the repo passes through a shell.** Requirement strings (`setuptools-scm >= 8.2`) are arguments
  of `pip`, one command per step (`sb.run([python, "-m", "pip", …])`); a failure names its step. A script built
  from them once turned `>` into a redirection: the bound was lost and an empty file `=8.2` appeared in every
  snapshot.
- **The prepared tree holds only the repo's files and the venv.** The sandboxed steps (pip, the project's build
  backend) may write anywhere in the tree. Their result contributes only its `.venv` and the regular `.py` files
  the editable build generated inside the repo's existing directories, test files excepted (setuptools-scm's
  `_version.py`, which the package imports; `Prepared.generated`); every repo file is the copy made before any of
  its code ran, and anything else they wrote (`*.egg-info`, `build/`, the wheelhouse, stray files, links) is
  dropped (`Prepared.dropped`).
"""

from __future__ import annotations

import configparser
import errno
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path, PurePosixPath

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from shipyard.harness.confined import Tree
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import remove_snapshot, snapshot_of, special_kind
from shipyard.tasks.downloads import Downloader, DownloadError, Sdist
from shipyard.tasks.patchscan import is_test_config

VENV = ".venv"
PYTHON = f"/workspace/{VENV}/bin/python"
TEST_GROUPS = ("test", "tests", "testing", "dev")
ALWAYS = ("pytest", "coverage", "pip")
WHEELHOUSE = ".shipyard-wheelhouse"
NOT_COPIED = frozenset({".git", VENV, "__pycache__", WHEELHOUSE})  # names never copied from the repo, at any depth
MAX_FETCH_ROUNDS = 3  # fetches for the build requirements of fetched sdists (which may name more sdists)
MAX_DEPTH = 64  # directory levels copied from the repo
SCRIPT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")  # a console script's file name: no separator, no dot first
# An entry point's value: `module.sub:attr.sub`, optionally with extras; nothing else becomes a script.
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
ENTRY_POINT = re.compile(rf"\s*(?P<module>{_DOTTED})\s*:\s*(?P<attr>{_DOTTED})\s*(?:\[[\w,\s-]*\])?\s*")
REQUIREMENT_FILES = ("requirements-test.txt", "requirements-tests.txt", "requirements_test.txt",
                     "test-requirements.txt", "test_requirements.txt", "requirements-testing.txt",
                     "requirements/test.txt", "requirements/tests.txt", "requirements/testing.txt",
                     "tests/requirements.txt", "test/requirements.txt")


class EnvSetupError(RuntimeError):
    """The repository's environment could not be prepared; the message says why and what to do."""


@dataclass
class Prepared:
    root: Path  # the repository with its `.venv`, ready to snapshot
    copied: list[str] = field(default_factory=list)  # distributions copied from the host
    downloaded: list[str] = field(default_factory=list)  # requirements fetched from the index
    sdists: list[str] = field(default_factory=list)  # name==version of the sdists fetched (built in the sandbox)
    files: list[str] = field(default_factory=list)  # the repo's files, as copied (links materialised included)
    skipped: dict[str, str] = field(default_factory=dict)  # repo path → why it was left out of the copy
    generated: list[str] = field(default_factory=list)  # .py files the editable build wrote, kept
    dropped: list[str] = field(default_factory=list)  # what the sandboxed steps wrote into the tree, dropped
    log: str = ""


def _copy_file(name: str, dest: Path, dir_fd: int | None = None) -> str | None:
    """Copy the regular file `name` (its last component not followed) to the new file `dest`; why not, or None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    with os.fdopen(fd, "rb") as src:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped since it was looked at
            return f"is a {special_kind(st.st_mode)}, not a regular file"
        with open(dest, "xb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    os.chmod(dest, (stat.S_IMODE(st.st_mode) & 0o777) | 0o600)
    return None


def _materialise(root: str, rel: str, dest: Path) -> str | None:
    """The symbolic link `rel` of the repo at the real path `root`, copied as the regular file it resolves to if
    that lies inside the repo; otherwise why it is left out."""
    link = os.path.join(root, rel)
    target = os.readlink(link)
    try:
        st = os.stat(link)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"is a symbolic link loop (to {target!r})"
        return f"is a dangling symbolic link (to {target!r})"
    real = os.path.realpath(link)
    if not real.startswith(root.rstrip("/") + "/"):
        return f"is a symbolic link to {target!r}, which leads out of the repository"
    inner = PurePosixPath(os.path.relpath(real, root))
    if NOT_COPIED & set(inner.parts):
        return f"is a symbolic link to {target!r}, into {next(p for p in inner.parts if p in NOT_COPIED)}"
    if stat.S_ISDIR(st.st_mode):
        return f"is a symbolic link to a directory ({target!r}); linked directories are not copied"
    if not stat.S_ISREG(st.st_mode):
        return f"is a symbolic link to a {special_kind(st.st_mode)}"
    return _copy_file(real, dest)


def copy_repository(repo: Path, dest: Path) -> dict[str, str]:
    """Copy the repo's directories and regular files (and links to regular files inside it, as copies) into the new
    directory `dest`, never following a link out of it; what was left out: path → why (see the module docstring)."""
    root = os.path.realpath(repo)
    tree = Tree(Path(root))
    skipped: dict[str, str] = {}
    dest.mkdir(parents=True)
    todo = [""]
    while todo:
        rel = todo.pop()
        fd = tree.open_dir(rel.split("/") if rel else [])  # each component O_NOFOLLOW: a real directory
        try:
            with os.scandir(fd) as it:
                names = sorted(entry.name for entry in it)
            for name in names:
                path = f"{rel}/{name}" if rel else name
                if name in NOT_COPIED:
                    continue
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                why = None
                if stat.S_ISDIR(st.st_mode):
                    if path.count("/") >= MAX_DEPTH:
                        why = f"is more than {MAX_DEPTH} directories deep"
                    else:
                        (dest / path).mkdir()
                        todo.append(path)
                elif stat.S_ISREG(st.st_mode):
                    why = _copy_file(name, dest / path, dir_fd=fd)
                elif stat.S_ISLNK(st.st_mode):
                    why = _materialise(root, path, dest / path)
                else:
                    why = f"is a {special_kind(st.st_mode)}, not a regular file"
                if why:
                    skipped[path] = why
        finally:
            os.close(fd)
    return skipped


def regular_files(root: Path, skip: frozenset[str] | set[str] = NOT_COPIED) -> list[str]:
    """The regular files under `root` (relative POSIX paths, sorted), found without following any link; directories
    named in `skip` are not entered, at any depth."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):  # never descends into a linked directory
        dirnames[:] = [d for d in dirnames if d not in skip]
        base = Path(dirpath).relative_to(root)
        for name in filenames:
            if stat.S_ISREG(os.lstat(os.path.join(dirpath, name)).st_mode):
                out.append((base / name).as_posix())
    return sorted(out)


def project_requirements(repo: Path) -> tuple[str | None, list[str], list[str]]:
    """(project name, its requirements incl. test groups, its build requirements) from pyproject.toml."""
    path = repo / "pyproject.toml"
    if not path.exists():
        return None, [], ["setuptools>=40.8"]
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, RecursionError) as e:  # a repository's file: nested past the parser's recursion
        raise EnvSetupError(f"{path} is not valid TOML ({e}); fix it before synthesizing tasks") from e
    try:
        project = data.get("project", {})
        reqs = list(project.get("dependencies", []))
        for group in TEST_GROUPS:
            reqs += project.get("optional-dependencies", {}).get(group, [])
            reqs += [r for r in data.get("dependency-groups", {}).get(group, []) if isinstance(r, str)]
        build = data.get("build-system", {}).get("requires", ["setuptools>=40.8"])
        name = project.get("name")
    except (AttributeError, TypeError):  # a table that is not one (`project = 5`), a list that is not one
        name = reqs = build = None
    if not (isinstance(name, str | None) and isinstance(reqs, list) and isinstance(build, list)
            and all(isinstance(r, str) for r in [*reqs, *build])):
        raise EnvSetupError(f"{path}: [project] (name, dependencies, optional-dependencies) or [build-system] requires "
                            "are not shaped as PEP 621 and PEP 518 say; fix it before synthesizing tasks")
    return name, reqs, build


def requirement_lines(text: str, where: Path, repo: Path, seen: set[Path]) -> list[str]:
    """Requirements in pip requirements-file text found at `where` (`-r` followed inside the repo; options, paths
    and URLs skipped)."""
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if line.startswith(("-r", "--requirement")):
            target = (where.parent / line.removeprefix("--requirement").removeprefix("-r").lstrip(" =")).resolve()
            if target.is_relative_to(repo.resolve()) and target.is_file() and target not in seen:
                seen.add(target)
                out += requirement_lines(target.read_text(errors="replace"), target, repo, seen)
        elif line and not line.startswith(("#", "-", ".", "/")) and "://" not in line and "{" not in line:
            try:
                out.append(str(Requirement(line)))
            except InvalidRequirement as e:
                why = str(e).splitlines()[0]
                raise EnvSetupError(f"{where.relative_to(repo)}:{number}: {line!r} is not a requirement ({why}); fix "
                                    "it, or name what the tests need with --with") from e
    return out


def requirements_for_tests(repo: Path) -> list[str]:
    """Requirements from the test requirement files and tox's `[testenv] deps`."""
    reqs: list[str] = []
    seen: set[Path] = set()
    for name in REQUIREMENT_FILES:
        path = repo / name
        if path.is_file() and path.resolve() not in seen:
            seen.add(path.resolve())
            reqs += requirement_lines(path.read_text(errors="replace"), path, repo, seen)
    tox = repo / "tox.ini"
    if tox.is_file():
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read_string(tox.read_text(errors="replace"))
        except configparser.Error as e:
            raise EnvSetupError(f"{tox} is not valid INI ({e}); fix it, or name what the tests need with --with") \
                from e
        deps = parser.get("testenv", "deps", fallback="").replace("{toxinidir}", str(repo))
        reqs += requirement_lines(deps, tox, repo, seen)
    return reqs


def _closure(requirements: list[str], own: str | None) -> tuple[list[metadata.Distribution], list[str]]:
    """Split requirements (and, for host copies, their dependencies) into host distributions and downloads."""
    env = default_environment() | {"extra": ""}
    found: dict[str, metadata.Distribution] = {}
    missing: list[str] = []
    todo = list(requirements)
    while todo:
        text = todo.pop()
        try:
            req = Requirement(text)
        except InvalidRequirement as e:
            raise EnvSetupError(f"bad requirement {text!r} in the project's metadata: {e}") from e
        name = canonicalize_name(req.name)
        if name == own or name in found or (req.marker and not req.marker.evaluate(env)):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            dist = None
        if dist is not None and req.specifier.contains(dist.version, prereleases=True):
            found[name] = dist
            todo += [r for r in (dist.requires or []) if "extra ==" not in r]
        else:
            missing.append(str(req))
    return list(found.values()), sorted(set(missing))


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def copy_distribution(dist: metadata.Distribution, site: Path) -> int:
    """Install a host distribution into `site` by copying the files its RECORD lists (scripts excepted: theirs run
    the host's interpreter; `write_scripts` makes the venv's own)."""
    count = 0
    for file in dist.files or []:
        if file.parts[0] == ".." or "__pycache__" in file.parts:
            continue
        src = Path(str(dist.locate_file(file)))
        if src.is_file():
            dest = site / file
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
            count += 1
    return count


def write_scripts(dist: metadata.Distribution, bin_dir: Path, python: str = PYTHON) -> list[str]:
    """Write the console scripts of a copied distribution (`pytest`, `pip`, `coverage`, …) into the venv's `bin`,
    each running `python` (the venv's, as seen inside a sandbox), so the agent's shell, which has the venv first on
    `PATH`, finds the project's `pytest` rather than one without the project (docs/harness.md). Only what a pip
    install would write: names and targets that are plain (no path separators, dotted identifiers), and no file that
    exists already; the script's text is made of the entry point's own names (the leak scanner's corpus holds the
    distribution's `entry_points.txt`). The names written."""
    written = []
    for ep in dist.entry_points.select(group="console_scripts"):
        target, value = bin_dir / ep.name, ENTRY_POINT.fullmatch(ep.value)
        if not SCRIPT_NAME.fullmatch(ep.name) or value is None or os.path.lexists(target):
            continue
        module, attr = value["module"], value["attr"]
        target.write_text(f"#!{python}\nimport sys\nfrom {module} import {attr.split('.')[0]}\nsys.exit({attr}())\n")
        target.chmod(0o755)
        written.append(ep.name)
    return written


def _fetch(requirements: list[str], own: str | None, wheelhouse: Path, cache: Path, index_url: str | None
           ) -> tuple[list[metadata.Distribution], list[str], list[Sdist], list[str]]:
    """Split `requirements` into host copies and downloads, and fetch the downloads into `wheelhouse` without running
    any of them; with the build requirements of the sdists fetched (copied or fetched too): (host distributions,
    downloaded requirements, sdists, the sdists' build requirements that were downloaded)."""
    host_dists, missing = _closure(requirements, own)
    if not missing:
        return host_dists, [], [], []
    with Downloader(wheelhouse, cache, index_url) as downloader:
        for _ in range(MAX_FETCH_ROUNDS):
            try:
                sdists = downloader.fetch(missing)
            except DownloadError as e:
                raise EnvSetupError(f"fetching the requirements failed: {e}") from e
            build = sorted({r for s in sdists for r in s.build_requires})
            host_dists, wanted = _closure([*requirements, *build], own)
            if set(wanted) == set(missing):
                names = {canonicalize_name(Requirement(r).name) for r in build}
                return host_dists, missing, sdists, [r for r in missing if canonicalize_name(Requirement(r).name)
                                                     in names]
            missing = wanted
    raise EnvSetupError(f"the build requirements of the sources fetched ({', '.join(s.filename for s in sdists)}) keep "
                        "naming more requirements published only as sources; install them on this host first")


def _steps(missing: list[str], build: list[str], has_project: bool) -> list[tuple[str, list[str]]]:
    """The commands run in the sandbox, each an argument list (what they are, argv): no shell ever parses a
    requirement string."""
    # No build isolation: an isolated build would fetch its build requirements, and the sandbox has no network; a
    # downloaded sdist builds with what the venv holds: its build requirements, installed by the first step.
    pip = [PYTHON, "-m", "pip", "install", "--quiet", "--no-index", "--no-build-isolation"]
    steps = []
    if build:
        steps.append(("install the build requirements of the downloaded sdists",
                      [*pip, "--find-links", f"/workspace/{WHEELHOUSE}", *build]))
    if missing:
        steps.append(("install the downloaded requirements", [*pip, "--find-links", f"/workspace/{WHEELHOUSE}",
                                                              *missing]))
    if has_project:
        steps.append(("install the project (editable)", [*pip, "--no-deps", "-e", "/workspace"]))
    steps.append(("check that pytest runs", [PYTHON, "-m", "pytest", "--version"]))
    return steps


def _run_steps(sb: Sandbox, repo: Path, steps: list[tuple[str, list[str]]], timeout: float, advice: str = "") -> str:
    """Run `steps` in order within `timeout` seconds in all; their output. EnvSetupError naming the failed step
    (and `advice`)."""
    env = sb.environment() | {"PIP_NO_INPUT": "1"}
    deadline = time.monotonic() + timeout
    log = ""
    for what, argv in steps:
        left = deadline - time.monotonic()
        result = sb.run(argv, timeout=max(1.0, left), env=env) if left > 0 else None
        if result is not None:
            log += f"$ {shlex.join(argv)}\n{result.output.decode(errors='replace')}"
        if result is None or result.timed_out or result.exit_code != 0:
            how = f"exit {result.exit_code}" if result is not None and not result.timed_out else \
                f"the {timeout:g} s given to preparing the environment ran out"
            raise EnvSetupError(f"preparing the environment of {repo} failed at the step '{what}' inside the sandbox "
                                f"({how}):\n{log[-3000:]}\n{advice}fix the requirement or the build named above, or "
                                "name what the tests need with --with")
    return log


def _settle(dest: Path, ready: Path, files: list[str]) -> tuple[list[str], list[str]]:
    """Make `dest` (the repo as copied, with a venv) hold the repo's files, the venv from `ready` (the tree after
    the sandboxed steps) and the `.py` files those steps generated in the repo's existing directories (test files
    excepted); (generated, dropped): what of `ready` was kept and what was left behind (module docstring)."""
    if not stat.S_ISDIR(os.lstat(ready / VENV).st_mode):
        raise EnvSetupError(f"preparing the environment replaced {VENV} with something that is not a directory (the "
                            "project's build did it); the environment cannot be used")
    shutil.rmtree(dest / VENV)
    shutil.rmtree(dest / WHEELHOUSE, ignore_errors=True)
    known = set(files)
    dirs = {""}  # the repo's directories, as copied
    for dirpath, dirnames, _ in os.walk(dest):
        here = Path(dirpath).relative_to(dest)
        dirs |= {(here / d).as_posix() for d in dirnames}
    shutil.copytree(ready / VENV, dest / VENV, symlinks=True)  # links in the venv resolve inside sandboxes
    generated, dropped = [], []
    for dirpath, dirnames, filenames in os.walk(ready):
        here = "" if Path(dirpath) == ready else Path(dirpath).relative_to(ready).as_posix()
        for name in list(dirnames):
            rel = f"{here}/{name}" if here else name
            if rel != VENV and rel not in dirs:
                dropped.append(rel)
        dirnames[:] = [d for d in dirnames if (f"{here}/{d}" if here else d) in dirs]
        for name in filenames:
            rel = f"{here}/{name}" if here else name
            if rel in known:
                continue  # the repo's own file: the copy made before any of its code ran stays
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode) and name.endswith(".py") and not is_test_config(rel) \
                    and not os.path.lexists(dest / rel) and _copy_file(os.path.join(dirpath, name), dest / rel) is None:
                generated.append(rel)
            else:
                dropped.append(rel)
    return sorted(generated), sorted(dropped)


def prepare(repo: Path, dest: Path, wheel_cache: Path, timeout: float = 900,
            extra: tuple[str, ...] = (), index_url: str | None = None) -> Prepared:
    """Copy `repo` to `dest` and give it a ready `.venv` (`extra`: more requirements, as `shipyard synth --with`;
    `index_url`: the package index, else pip's configured one)."""
    if dest.exists():
        shutil.rmtree(dest)
    skipped = copy_repository(repo, dest)
    files = regular_files(dest)
    name, reqs, build = project_requirements(dest)
    own = canonicalize_name(name) if name else None
    host_dists, missing, sdists, sdist_build = _fetch([*reqs, *requirements_for_tests(dest), *extra, *build, *ALWAYS],
                                                      own, dest / WHEELHOUSE, wheel_cache, index_url)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest / VENV)], check=True)
    site = _site_packages(dest / VENV)
    for dist in host_dists:
        copy_distribution(dist, site)
        write_scripts(dist, dest / VENV / "bin")
    prepared = Prepared(dest, sorted(f"{d.metadata['Name']}=={d.version}" for d in host_dists), missing,
                        sorted(f"{s.name}=={s.version}" for s in sdists), files, skipped)
    guessed = [s.filename for s in sdists if not s.declared]
    advice = (f"the dependencies of {', '.join(guessed)} are not declared statically in their metadata, so they were "
              "guessed before the build; if one is missing above, name it with --with; ") if guessed else ""
    has_project = (dest / "pyproject.toml").is_file() or (dest / "setup.py").is_file()
    with snapshot_of(dest, host()) as snap, Sandbox(snap) as sb:
        prepared.log = _run_steps(sb, repo, _steps(missing, sdist_build, has_project), timeout, advice)
        ready = sb.save_snapshot()
    try:
        prepared.generated, prepared.dropped = _settle(dest, ready, files)
    finally:
        remove_snapshot(ready)
    return prepared
