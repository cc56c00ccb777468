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
  host's site-packages (its `RECORD`; offline, milliseconds); the rest is downloaded from PyPI on the host
  (`pip download`, into a cached wheelhouse) and installed inside a sandbox with `--no-index`, so any package
  build script runs sandboxed;
- the project itself, editable (`pip install -e /workspace` inside a sandbox, no network): a path pointer, never
  a copy of its code in site-packages — a copy would hand the deleted code back to the agent.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot

VENV = ".venv"
PYTHON = f"/workspace/{VENV}/bin/python"
TEST_GROUPS = ("test", "tests", "testing", "dev")
ALWAYS = ("pytest", "coverage", "pip")
WHEELHOUSE = ".shipyard-wheelhouse"
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
    downloaded: list[str] = field(default_factory=list)  # requirements fetched from PyPI
    log: str = ""


def project_requirements(repo: Path) -> tuple[str | None, list[str], list[str]]:
    """(project name, its requirements incl. test groups, its build requirements) from pyproject.toml."""
    path = repo / "pyproject.toml"
    if not path.exists():
        return None, [], ["setuptools>=40.8"]
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise EnvSetupError(f"{path} is not valid TOML ({e}); fix it before synthesizing tasks") from e
    project = data.get("project", {})
    reqs = list(project.get("dependencies", []))
    for group in TEST_GROUPS:
        reqs += project.get("optional-dependencies", {}).get(group, [])
        reqs += [r for r in data.get("dependency-groups", {}).get(group, []) if isinstance(r, str)]
    build = data.get("build-system", {}).get("requires", ["setuptools>=40.8"])
    return project.get("name"), reqs, build


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
    """Install a host distribution into `site` by copying the files its RECORD lists (scripts excepted)."""
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


def _download(requirements: list[str], cache: Path) -> Path:
    """`pip download` on the host (the sandbox has no network) into a wheelhouse; any failure says which."""
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(cache), *requirements],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise EnvSetupError(f"could not download {', '.join(requirements)} from PyPI:\n{proc.stderr[-2000:]}\n"
                                "check the network or the requirement, or install them on this host first "
                                "(host-installed distributions are copied without a download)")
    return cache


def prepare(repo: Path, dest: Path, wheel_cache: Path, timeout: float = 900,
            extra: tuple[str, ...] = ()) -> Prepared:
    """Copy `repo` to `dest` and give it a ready `.venv` (`extra`: more requirements, as `shipyard synth --with`)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(repo, dest, symlinks=True, ignore=shutil.ignore_patterns(".git", VENV, "__pycache__"))
    name, reqs, build = project_requirements(dest)
    own = canonicalize_name(name) if name else None
    host_dists, missing = _closure([*reqs, *requirements_for_tests(dest), *extra, *build, *ALWAYS], own)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest / VENV)], check=True)
    site = _site_packages(dest / VENV)
    for dist in host_dists:
        copy_distribution(dist, site)
    prepared = Prepared(dest, sorted(f"{d.metadata['Name']}=={d.version}" for d in host_dists), missing)
    if missing:
        wheels = _download(missing, wheel_cache)
        shutil.copytree(wheels, dest / WHEELHOUSE)
    has_project = (dest / "pyproject.toml").exists() or (dest / "setup.py").exists()
    script = "set -e\n"
    if missing:
        script += f"{PYTHON} -m pip install --quiet --no-index --find-links {WHEELHOUSE} {' '.join(missing)!s}\n"
    if has_project:
        script += f"{PYTHON} -m pip install --quiet --no-deps --no-build-isolation --no-index -e .\n"
    script += f"{PYTHON} -m pytest --version\n"
    h = host()
    snap = make_snapshot(dest, h)
    try:
        with Sandbox(snap) as sb:
            result = sb.run(["bash", "-c", script], timeout=timeout, env=sb.environment() | {"PIP_NO_INPUT": "1"})
            prepared.log = result.output.decode(errors="replace")
            if result.exit_code != 0 or result.timed_out:
                raise EnvSetupError(f"preparing the environment of {repo} failed inside the sandbox "
                                        f"(exit {result.exit_code}):\n{prepared.log[-3000:]}")
            ready = sb.save_snapshot()
    finally:
        remove_snapshot(snap)
    shutil.rmtree(dest)
    shutil.copytree(ready, dest, symlinks=True)
    remove_snapshot(ready)
    shutil.rmtree(dest / WHEELHOUSE, ignore_errors=True)
    for leftover in dest.glob("*.egg-info"):
        shutil.rmtree(leftover)
    return prepared

