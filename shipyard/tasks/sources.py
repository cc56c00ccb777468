"""Where a task set's repositories come from: local directories, and projects on the package index by name.

`shipyard synth` (and the benchmarks that synthesize from real projects) take *specs* of two kinds:

* **A directory**: an existing directory, or any spec with a `/` or starting with `.` or `~` (which must then
  exist). An existing directory wins over a project of the same name: write `./parse` or `parse==1.22.4` to say
  which.
* **A project on the index**: `name` (its newest release) or a requirement such as `name==1.22.4` (any PEP 440
  specifier; no extras, markers or URL). Its source distribution is fetched from the index's simple API, the index
  pip is configured with or `index_url` (`downloads.pip_settings`), exactly as an environment's sdists are
  (`downloads.choose_sdist`: the newest release the specifier allows; yanked files and files whose Requires-Python
  excludes this interpreter left out; the sha256 the index publishes checked, `downloads.download`), and unpacked
  into a work directory: members are counted and their sizes summed before anything is written (`MAX_MEMBERS`,
  `MAX_UNPACKED`), and a tar is unpacked with Python's `data` filter (no absolute paths, no `..`, no links out of
  the tree, no device files). The archive's single top directory is the repository. Sdists are source: nothing in
  them runs on the host; synthesis builds and tests them only inside sandboxes.

Each source knows its **project** (`taskset.Project`), which task ids and a held-out split by project go by. For a
fetched sdist it is the release fetched. For a directory it is what its metadata states statically — pyproject's
`[project]` name and version, else `PKG-INFO`'s Name and Version (an unpacked sdist), else setup.cfg's `[metadata]`
— read without following a link (the repository is untrusted), else the directory's name and no version.

`resolve` resolves every spec (fetching every sdist) before any synthesis starts, so a bad spec fails first, and
refuses two specs of the same project: a task set holds one synthesis report per project.
"""

from __future__ import annotations

import configparser
import io
import tarfile
import tempfile
import tomllib
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath

from packaging.requirements import InvalidRequirement, Requirement

from shipyard.errors import InputNotFound, UsageError, UserError
from shipyard.harness.confined import PathError, Tree
from shipyard.tasks.downloads import (
    MAX_MEMBERS,
    MAX_UNPACKED,
    DownloadError,
    choose_sdist,
    download,
    pip_settings,
    project_files,
)
from shipyard.tasks.taskset import Project, project_name

MAX_METADATA = 1 << 20  # bytes of one metadata file read from a directory


class SourceError(UserError, RuntimeError):
    """A spec could not be turned into a source tree (not on the index, no sdist, a bad archive); the message says
    which and why."""


@dataclass(frozen=True)
class Source:
    spec: str  # as the user wrote it
    path: Path  # the repository: the directory, or the unpacked sdist's top directory
    project: Project


def is_directory_spec(spec: str, base: Path | None = None) -> bool:
    """Whether `spec` names a directory (see the module docstring) rather than a project on the index."""
    return "/" in spec or spec.startswith((".", "~")) or (Path(base or ".") / spec).is_dir()


def _metadata(tree: Tree, rel: str) -> str | None:
    try:
        return tree.read(rel, MAX_METADATA).decode("utf-8", "replace")
    except (PathError, OSError):
        return None  # absent, a link, not a regular file, too large: the next source of metadata is asked


def _stated(repo: Path) -> tuple[str | None, str | None]:
    """(name, version) the directory's metadata states statically, each None where none does."""
    tree = Tree(repo)
    name = version = None
    if (text := _metadata(tree, "pyproject.toml")) is not None:
        try:
            table = tomllib.loads(text).get("project")
        except (tomllib.TOMLDecodeError, RecursionError):  # nested past the parser's recursion: no usable table
            table = None
        if isinstance(table, dict):
            name = table.get("name") if isinstance(table.get("name"), str) else None
            version = table.get("version") if isinstance(table.get("version"), str) else None
    if (name is None or version is None) and (text := _metadata(tree, "PKG-INFO")) is not None:
        info = HeaderParser().parsestr(text)
        name, version = name or info.get("Name"), version or info.get("Version")
    if (name is None or version is None) and (text := _metadata(tree, "setup.cfg")) is not None:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read_string(text)
            meta = parser["metadata"] if parser.has_section("metadata") else {}
        except configparser.Error:
            meta = {}
        stated = meta.get("version", "").strip()
        name = name or meta.get("name", "").strip() or None
        version = version or (stated if stated and not stated.startswith(("attr:", "file:")) else None)
    return name, version


def directory_project(repo: Path) -> Project:
    """The project of the repository `repo` (module docstring)."""
    repo = Path(repo).resolve()
    name, version = _stated(repo)
    project = Project(project_name(name or repo.name), (version or "").strip() or None)
    if project.problem():  # a version no record can hold (spaces, a template): the release is not known
        project = Project(project.name)
    return project


def _unpack(data: bytes, filename: str, dest: Path) -> Path:
    """The sdist archive `data` unpacked into `dest` (module docstring); its single top directory."""
    try:
        if filename.lower().endswith(".zip"):
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                members = archive.infolist()
                names = [m.filename for m in members]
                total = sum(m.file_size for m in members)
                unsafe = [n for n in names if n.startswith("/") or ".." in PurePosixPath(n).parts]
                if len(members) <= MAX_MEMBERS and total <= MAX_UNPACKED and not unsafe:
                    archive.extractall(dest)
        else:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
                members = archive.getmembers()
                names = [m.name for m in members]
                total = sum(m.size for m in members)
                unsafe = []
                if len(members) <= MAX_MEMBERS and total <= MAX_UNPACKED:
                    archive.extractall(dest, filter="data")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        raise SourceError(f"{filename} cannot be unpacked ({str(e)[:200]}); refusing it") from None
    if len(members) > MAX_MEMBERS or total > MAX_UNPACKED:
        raise SourceError(f"{filename} is too large to unpack (over {MAX_MEMBERS} members or {MAX_UNPACKED >> 30} GiB)")
    if unsafe:
        raise SourceError(f"{filename} holds paths outside its own tree ({unsafe[0][:100]!r}); refusing it")
    tops = {PurePosixPath(n).parts[0] for n in names if PurePosixPath(n).parts}
    roots = [dest / t for t in tops if (dest / t).is_dir() and not (dest / t).is_symlink()]
    if len(tops) != 1 or len(roots) != 1:
        raise SourceError(f"{filename} does not hold one top directory (it holds {len(tops)} entries at its top); an "
                          "sdist unpacks into name-version/")
    return roots[0]


def fetch_sdist(spec: str, work: Path, index_url: str | None = None, cache: Path | None = None) -> Source:
    """The sdist of the requirement `spec` (module docstring), fetched, checked and unpacked under `work`."""
    try:
        req = Requirement(spec)
    except InvalidRequirement as e:
        raise UsageError(f"{spec!r} is neither a directory nor a requirement such as parse==1.22.4 "
                         f"({str(e).splitlines()[0]})") from None
    if req.extras or req.marker or req.url:
        raise UsageError(f"{spec!r}: a project to synthesize from is a name and a version (parse==1.22.4), without "
                         "extras, markers or URL")
    settings = pip_settings(index_url)
    try:
        files = project_files(req.name, settings)
        chosen = choose_sdist(files, req)
        if chosen is None:
            raise SourceError(f"{spec}: no source distribution of a release it allows on {settings.names()} (tasks "
                              "are made from an sdist, which holds the tests; a wheel does not)")
        version, file = chosen
        data = download(file, settings, cache)
    except DownloadError as e:
        raise SourceError(f"{spec}: {e}") from None
    Path(work).mkdir(parents=True, exist_ok=True)
    dest = Path(tempfile.mkdtemp(prefix=f"{project_name(req.name)}-{version}-", dir=work))
    return Source(spec, _unpack(data, file.filename, dest), Project(project_name(req.name), str(version)))


def resolve(specs: Iterable[str], work: Path, index_url: str | None = None, cache: Path | None = None) \
        -> list[Source]:
    """Every spec as a source tree with its project, in order (sdists fetched under `work`); UsageError when two
    specs are the same project."""
    sources: list[Source] = []
    for spec in specs:
        if is_directory_spec(spec):
            path = Path(spec).expanduser()
            if not path.is_dir():
                raise InputNotFound(f"--repo {spec} is not a directory")
            source = Source(spec, path.resolve(), directory_project(path))
        else:
            source = fetch_sdist(spec, work, index_url, cache)
        twin = next((s for s in sources if s.project.name == source.project.name), None)
        if twin is not None:
            raise UsageError(f"{twin.spec} and {spec} are both project {source.project.name}: a task set holds one "
                             "synthesis of each project")
        sources.append(source)
    if not sources:
        raise UsageError("no repository to synthesize from: give --repo (a directory or name==version) or --repos FILE")
    return sources
