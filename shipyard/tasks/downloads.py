"""Requirements fetched on the host for a task's environment, without ever running code from what is fetched.

The sandbox that installs a task's venv has no network, so what the host does not have is fetched on the host first.
The requirement names come from the repository, which is untrusted, and `pip download` of a requirement published
only as a source distribution runs that sdist's build backend (setup.py, the PEP 517 metadata hooks) on the host, as
the synthesizing user, to learn its dependencies: any sdist on the index, named directly or as a dependency of a
dependency, would run there. So:

- **Wheels through pip, sdists never.** `pip download --only-binary=:all:` resolves and fetches wheels only (a wheel's
  metadata is a file; nothing in it runs when it is downloaded).
- **An sdist is fetched as a file.** For a requirement pip finds no wheel for ("No matching distribution found for
  X"), the sdist is taken from the index's simple API (PEP 691 JSON or PEP 503 HTML, `file://` indexes too — what
  pip reads): the newest version the specifier allows (prereleases as PEP 440 says; yanked files and files whose
  Requires-Python excludes this interpreter left out), its sha256 checked against the one the index publishes.
- **Read statically.** Its dependencies and build requirements are read from the archive in memory (tarfile/zipfile,
  nothing extracted): `PKG-INFO`'s Requires-Dist are the sdist's dependencies when its Metadata-Version is 2.2 or
  later and Requires-Dist is not Dynamic (PEP 643: then every build must produce them); otherwise they are
  *undeclared* — Requires-Dist, or the `*.egg-info/requires.txt` setuptools packs, is a hint, and the sandboxed
  install is the judge. `pyproject.toml`'s `[build-system] requires` are its build requirements.
- **One resolution.** Each fetched sdist is stood in for by a stub wheel (metadata only: its name, version and those
  dependencies) in a private find-links directory and pip runs again, so the wheels resolve together with the sdists'
  dependencies. Stubs never leave that directory and the run's wheelhouse (they are removed from it, and never
  cached). The sdists build later, inside the sandbox step that installs with `--no-index --no-build-isolation`.

The index is pip's: `index_url` when given (and then passed to pip as `--index-url`), else pip's own configuration
(`pip config list`: `PIP_INDEX_URL`, pip.conf's `index-url`, `extra-index-url`, `no-index`, `cert`), else PyPI. Wheels
may also come from pip's find-links; sdists only from the indexes.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import json
import lzma
import os
import platform
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass, field
from email.parser import HeaderParser
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit
from urllib.request import url2pathname

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import sys_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

PYPI = "https://pypi.org/simple"
ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
SDIST_EXTENSIONS = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip")
STUB_BUILD = "0shipyardstub"  # the build tag of stub wheels (no real wheel carries it)
MAX_SDISTS = 32  # sdists fetched for one environment
MAX_PAGE = 32 << 20  # bytes of one index page
MAX_SDIST = 256 << 20  # bytes of one sdist
MAX_META = 1 << 20  # bytes of one metadata file read from an sdist
MAX_MEMBERS = 100_000  # archive members looked at
MAX_UNPACKED = 2 << 30  # bytes of archive content read past
TIMEOUT = 60.0  # seconds per network operation
PIP_TIMEOUT = 1800.0  # seconds for one `pip download`
NO_MATCH = re.compile(r"No matching distribution found for (.+?)\s*$", re.M)
EXTRA = re.compile(r"""\bextra\s*==\s*["']([A-Za-z0-9._-]+)["']""")
ADVICE = ("install it on this host first (distributions installed on the host are copied, never downloaded), or put "
          "a wheel of it where pip finds one (--find-links, PIP_FIND_LINKS)")


class DownloadError(RuntimeError):
    """A requirement could not be fetched without running its code; the message says which and what to do."""


@dataclass
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    requires_python: str | None = None
    yanked: bool = False


@dataclass
class Sdist:
    name: str  # canonical
    version: str
    filename: str
    requires: list[str]  # its dependencies, as Requires-Dist (markers and extras kept)
    extras: list[str]
    declared: bool  # `requires` are its static metadata (PEP 643), not a hint
    build_requires: list[str]


@dataclass
class Settings:
    """Where pip looks, as pip is configured (module docstring)."""
    indexes: list[str]  # the index and the extra indexes, in pip's order; empty: no index
    cafile: str | None = None

    def names(self) -> str:
        """The indexes as a message names them (credentials left out)."""
        return ", ".join(i.rpartition("@")[2] for i in self.indexes)


def pip_settings(index_url: str | None) -> Settings:
    """pip's effective index configuration for `pip download` (`pip config list`: its [global], then [download],
    then environment variables win), with `index_url` first when given."""
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired as e:
        raise DownloadError("`pip config list` did not answer within 120 s; check pip's configuration") from e
    values: dict[str, str] = {}
    lines = [line.partition("=") for line in proc.stdout.splitlines()]
    for section in ("global", "download", ":env:"):
        for key, sep, raw in lines:
            where, _, option = key.partition(".")
            if sep and where == section:
                try:
                    values[option] = str(ast.literal_eval(raw))
                except (ValueError, SyntaxError):
                    continue
    if values.get("no-index", "").lower() in ("1", "y", "yes", "t", "true", "on"):
        return Settings([], values.get("cert"))
    return Settings([index_url or values.get("index-url") or PYPI, *values.get("extra-index-url", "").split()],
                    values.get("cert"))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a" and dict(attrs).get("href"):
            self.links.append(dict(attrs))


def _open(url: str, settings: Settings, accept: str | None = None):
    parts = urlsplit(url)
    headers = {"User-Agent": "shipyard"} | ({"Accept": accept} if accept else {})
    if parts.username is not None:  # credentials in the index URL, as pip takes them
        token = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(token).decode()
        url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    context = ssl.create_default_context(cafile=settings.cafile) if settings.cafile else None
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT, context=context)


def _read(url: str, settings: Settings, limit: int, accept: str | None = None) -> tuple[bytes, str] | None:
    """The body and content type at `url` (http(s) or file), at most `limit` bytes; None where there is nothing."""
    what = url.rpartition("@")[2]
    if url.startswith("file:"):
        path = Path(url2pathname(urlsplit(url).path))
        path = path / "index.html" if path.is_dir() else path
        if not path.is_file():
            return None
        with open(path, "rb") as f:
            body, kind = f.read(limit + 1), "text/html"
    else:
        try:
            with _open(url, settings, accept) as response:
                body, kind = response.read(limit + 1), response.headers.get_content_type()
        except urllib.error.HTTPError as e:
            if e.code in (404, 410):
                return None
            raise DownloadError(f"{what} answered HTTP {e.code} ({e.reason}); check the index configuration "
                                "(PIP_INDEX_URL, pip.conf) and the network") from e
        except (urllib.error.URLError, OSError) as e:
            raise DownloadError(f"could not fetch {what} ({getattr(e, 'reason', e)}); check the network and the index "
                                "configuration (PIP_INDEX_URL, pip.conf)") from e
    if len(body) > limit:
        raise DownloadError(f"{what} is larger than {limit >> 20} MiB; refusing it")
    return body, kind


def index_files(index: str, name: str, settings: Settings) -> list[IndexFile] | None:
    """The files the simple API at `index` lists for project `name`; None if the index does not know it."""
    page = f"{index.rstrip('/')}/{canonicalize_name(name)}/"
    got = _read(page, settings, MAX_PAGE, ACCEPT)
    if got is None:
        return None
    body, kind = got
    out = []
    try:
        if kind == "application/vnd.pypi.simple.v1+json":
            for entry in json.loads(body)["files"]:
                out.append(IndexFile(str(entry["filename"]), urljoin(page, str(entry["url"])).partition("#")[0],
                                     (entry.get("hashes") or {}).get("sha256"), entry.get("requires-python"),
                                     bool(entry.get("yanked"))))
        else:
            parser = _Links()
            parser.feed(body.decode("utf-8", "replace"))
            for link in parser.links:
                url, _, fragment = urljoin(page, str(link["href"])).partition("#")
                algorithm, _, digest = fragment.partition("=")
                out.append(IndexFile(PurePosixPath(unquote(urlsplit(url).path)).name, url,
                                     digest if algorithm == "sha256" else None, link.get("data-requires-python"),
                                     "data-yanked" in link))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DownloadError(f"{page.rpartition('@')[2]} is not a simple-API page ({e}); check the index "
                            "configuration") from e
    return out


def project_files(name: str, settings: Settings, what: str | None = None) -> list[IndexFile]:
    """Every file the configured indexes list for project `name`; DownloadError when pip has no index (`what` says
    what was looked for) or none of them knows the project."""
    if not settings.indexes:
        raise DownloadError(f"{what or name}, and pip is configured with no index (no-index) to fetch its source "
                            f"distribution from; {ADVICE}")
    listed = [index_files(index, name, settings) for index in settings.indexes]
    if all(files is None for files in listed):
        raise DownloadError(f"{name} is on none of the indexes ({settings.names()}); check the requirement's name, "
                            f"or {ADVICE}")
    return [f for files in listed for f in files or []]


def sdist_version(filename: str, name: str) -> Version | None:
    """The version of `filename` if it is a source distribution of project `name` (canonical)."""
    extension = next((e for e in SDIST_EXTENSIONS if filename.lower().endswith(e)), None)
    if extension is None or "/" in filename or filename.startswith("."):
        return None
    stem = filename[:-len(extension)]
    for i, char in enumerate(stem):
        if char == "-" and canonicalize_name(stem[:i]) == name:
            try:
                return Version(stem[i + 1:])
            except InvalidVersion:
                continue
    return None


def _python_ok(requires_python: str | None) -> bool:
    try:
        return not requires_python or SpecifierSet(requires_python).contains(platform.python_version(), True)
    except InvalidSpecifier:
        return False


def has_wheel(files: list[IndexFile], req: Requirement) -> bool:
    """Whether `files` hold a wheel this interpreter can install, of a version `req` allows."""
    tags, versions = set(sys_tags()), set()
    for f in files:
        try:
            name, version, _, wheel_tags = parse_wheel_filename(f.filename)
        except InvalidWheelFilename:
            continue
        if name == canonicalize_name(req.name) and tags & wheel_tags and _python_ok(f.requires_python) \
                and not f.yanked:
            versions.add(version)
    return any(True for _ in req.specifier.filter(versions))


def choose_sdist(files: list[IndexFile], req: Requirement) -> tuple[Version, IndexFile] | None:
    """The sdist of the newest version `req` allows (yanked ones only when pinned with ==, as PEP 592 says)."""
    name = canonicalize_name(req.name)
    found: dict[Version, list[IndexFile]] = {}
    for f in files:
        version = sdist_version(f.filename, name)
        if version is not None and _python_ok(f.requires_python):
            found.setdefault(version, []).append(f)
    allowed = list(req.specifier.filter(found))
    pinned = any(s.operator in ("==", "===") for s in req.specifier)
    pool = [v for v in allowed if any(not f.yanked for f in found[v])] or (allowed if pinned else [])
    if not pool:
        return None
    version = max(pool)
    return version, min(found[version], key=lambda f: (f.yanked, not f.filename.endswith(".tar.gz")))


def read_members(data: bytes, filename: str) -> dict[str, bytes]:
    """`PKG-INFO` and `pyproject.toml` at the archive's top and an `*.egg-info/requires.txt`, read in memory."""
    found: dict[str, bytes] = {}

    def key(path: str, size: int) -> str | None:
        parts = PurePosixPath(path).parts
        if len(parts) == 2 and parts[1] in ("PKG-INFO", "pyproject.toml"):
            wanted = parts[1]
        elif 3 <= len(parts) <= 4 and parts[-1] == "requires.txt" and parts[-2].endswith(".egg-info"):
            wanted = "requires.txt"
        else:
            return None
        return wanted if wanted not in found and size <= MAX_META else None

    try:
        if filename.lower().endswith(".zip"):
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                for info in archive.infolist()[:MAX_MEMBERS]:
                    if not info.is_dir() and (wanted := key(info.filename, info.file_size)):
                        with archive.open(info) as member:
                            found[wanted] = member.read(MAX_META)
        else:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
                for count, member in enumerate(archive):
                    if count >= MAX_MEMBERS or member.offset_data + member.size > MAX_UNPACKED:
                        raise DownloadError(f"{filename} is too large to read (over {MAX_MEMBERS} members or "
                                            f"{MAX_UNPACKED >> 30} GiB); refusing it")
                    if member.isfile() and (wanted := key(member.name, member.size)):
                        found[wanted] = archive.extractfile(member).read(MAX_META)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, zlib.error, lzma.LZMAError) as e:
        raise DownloadError(f"{filename} is not a readable archive ({e}); refusing it") from e
    return found


def egg_requires(text: str) -> list[str]:
    """setuptools' `requires.txt` (sections `[extra:marker]`) as Requires-Dist strings."""
    out, extra, marker = [], "", ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            extra, _, marker = line[1:-1].partition(":")
        elif line and not line.startswith("#"):
            conditions = [f"({marker})" if marker else "", f'extra == "{extra}"' if extra else ""]
            condition = " and ".join(c for c in conditions if c)
            out.append(f"{line} ; {condition}" if condition else line)
    return out


def _requirements(texts: list[str], what: str) -> list[str]:
    out = []
    for text in texts:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue  # a hint we cannot read; the sandboxed install is the judge
        if req.url:
            raise DownloadError(f"{what} requires {req.name} by URL ({req.url}); only the index is fetched from: "
                                f"{ADVICE}")
        out.append(str(req))
    return out


def sdist_metadata(name: str, version: Version, filename: str, data: bytes) -> Sdist:
    """What `data`, the sdist `filename`, says statically (module docstring)."""
    files = read_members(data, filename)
    if "PKG-INFO" not in files:
        raise DownloadError(f"{filename} has no PKG-INFO at its top, so it is not a source distribution; {ADVICE}")
    info = HeaderParser().parsestr(files["PKG-INFO"].decode("utf-8", "replace"))
    try:
        same = canonicalize_name(info.get("Name", "")) == name and Version(info.get("Version", "")) == version
        modern = Version(info.get("Metadata-Version", "0")) >= Version("2.2")
    except InvalidVersion:
        same = modern = False
    if not same:
        raise DownloadError(f"{filename}'s PKG-INFO names {info.get('Name')!r} {info.get('Version')!r}, not the "
                            f"release the index lists; refusing it")
    declared = modern and "requires-dist" not in {d.strip().lower() for d in info.get_all("Dynamic") or []}
    texts = info.get_all("Requires-Dist") or []
    if not declared and not texts and "requires.txt" in files:
        texts = egg_requires(files["requires.txt"].decode("utf-8", "replace"))
    requires = _requirements([str(t) for t in texts], filename)
    extras = sorted({str(e).strip() for e in info.get_all("Provides-Extra") or []} |
                    {m for r in requires for m in EXTRA.findall(r)})
    build = ["setuptools>=40.8.0"]  # pip's default for a tree without a [build-system] table
    try:
        system = tomllib.loads(files.get("pyproject.toml", b"").decode("utf-8", "replace")).get("build-system")
    except (tomllib.TOMLDecodeError, RecursionError):  # nested past the parser's recursion: as good as none
        system = None
    if isinstance(system, dict) and isinstance(system.get("requires"), list):
        build = _requirements([str(r) for r in system["requires"]], f"{filename} (its build)")
    return Sdist(name, str(version), filename, requires, [e for e in extras if re.fullmatch(r"[\w.-]+", e)],
                 declared, build)


def stub_wheel(directory: Path, sdist: Sdist) -> str:
    """A wheel holding only `sdist`'s metadata, so pip resolves around it; its file name."""
    dist = f"{re.sub(r'[-_.]+', '_', sdist.name)}-{sdist.version}"
    meta = (f"Metadata-Version: 2.1\nName: {sdist.name}\nVersion: {sdist.version}\n"
            + "".join(f"Provides-Extra: {e}\n" for e in sdist.extras)
            + "".join(f"Requires-Dist: {r}\n" for r in sdist.requires))
    files = {f"{dist}.dist-info/METADATA": meta,
             f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: shipyard-stub\nRoot-Is-Purelib: true\n"
                                        f"Build: {STUB_BUILD}\nTag: py3-none-any\n",
             f"{dist}.dist-info/RECORD": ""}
    filename = f"{dist}-{STUB_BUILD}-py3-none-any.whl"
    with zipfile.ZipFile(directory / filename, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return filename


@dataclass
class Downloader:
    """Fetches requirements into `wheelhouse` (wheels by pip, sdists as files; module docstring). `cache` keeps what
    was fetched for later runs (pip reads its wheels as find-links; sdists are reused when their sha256 matches)."""
    wheelhouse: Path
    cache: Path
    index_url: str | None = None
    sdists: dict[str, Sdist] = field(default_factory=dict)  # canonical name → the sdist fetched for it
    stubs: list[str] = field(default_factory=list)
    _settings: Settings | None = None
    _stub_dir: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> Downloader:
        self._stub_dir = tempfile.TemporaryDirectory(prefix="shipyard-stubs-")
        return self

    def __exit__(self, *exc) -> None:
        if self._stub_dir is not None:
            self._stub_dir.cleanup()

    def fetch(self, requirements: list[str]) -> list[Sdist]:
        """Fetch `requirements` and their dependencies; the sdists among them (which the sandbox builds)."""
        assert self._stub_dir is not None, "use Downloader as a context manager"
        for text in requirements:
            if Requirement(text).url:
                raise DownloadError(f"{text!r} names a URL; only the index is fetched from: {ADVICE}")
        self.wheelhouse.mkdir(parents=True, exist_ok=True)
        cached = ["--find-links", str(self.cache)] if self.cache.is_dir() else []
        argv = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--progress-bar", "off",
                "--dest", str(self.wheelhouse), "--find-links", self._stub_dir.name, *cached,
                *(["--index-url", self.index_url] if self.index_url else []), *requirements]
        for _ in range(MAX_SDISTS + 1):
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, env=os.environ | {"PIP_NO_INPUT": "1"},
                                      timeout=PIP_TIMEOUT)
            except subprocess.TimeoutExpired as e:
                raise DownloadError(f"pip download of {', '.join(requirements)} took more than {PIP_TIMEOUT:g} s; "
                                    "check the network and the index") from e
            if proc.returncode == 0:
                break
            output = (proc.stderr or proc.stdout)[-2000:]
            missing = NO_MATCH.findall(proc.stderr)
            if not missing:
                raise DownloadError(f"pip could not download {', '.join(requirements)} as wheels:\n{output}\ncheck the "
                                    "requirements and the network")
            sdist = self._sdist(missing[-1], output)
            self.sdists[sdist.name] = sdist
            self.stubs.append(stub_wheel(Path(self._stub_dir.name), sdist))
        else:
            raise DownloadError(f"more than {MAX_SDISTS} requirements have no wheel: {', '.join(self.sdists)}; "
                                f"{ADVICE}")
        for stub in self.stubs:
            (self.wheelhouse / stub).unlink(missing_ok=True)
        self.cache.mkdir(parents=True, exist_ok=True)
        for path in self.wheelhouse.iterdir():
            if path.is_file() and not (self.cache / path.name).exists():
                shutil.copy2(path, self.cache / path.name)
        return sorted(self.sdists.values(), key=lambda s: s.name)

    def _sdist(self, text: str, output: str) -> Sdist:
        """The sdist for the requirement `text`, which pip found no wheel for (its `output`), fetched and read."""
        try:
            req = Requirement(text)
        except InvalidRequirement as e:
            raise DownloadError(f"pip could not download a requirement it names {text!r}:\n{output}") from e
        name = canonicalize_name(req.name)
        where = f"{req} has no wheel for this platform (Python {platform.python_version()})"
        if name in self.sdists:
            raise DownloadError(f"{where}, and pip cannot use its sdist {self.sdists[name].filename}:\n{output}\n"
                                f"{ADVICE}")
        if self._settings is None:
            self._settings = pip_settings(self.index_url)
        files = project_files(req.name, self._settings, f"{where} where pip looks")
        if has_wheel(files, req):
            raise DownloadError(f"pip could not download {req} although the index lists a wheel for it:\n{output}\n"
                                "check the network and pip's configuration")
        chosen = choose_sdist(files, req)
        if chosen is None:
            raise DownloadError(f"{where}, and no source distribution of a version it allows either, on "
                                f"{self._settings.names()}; {ADVICE}")
        version, file = chosen
        data = download(file, self._settings, self.cache)
        sdist = sdist_metadata(name, version, file.filename, data)
        (self.wheelhouse / file.filename).write_bytes(data)
        return sdist


def download(file: IndexFile, settings: Settings, cache: Path | None = None) -> bytes:
    """The bytes of the sdist `file`, from `cache` (when it holds them) or the index, matching the sha256 the index
    publishes; at most MAX_SDIST bytes."""
    if not file.sha256 or not re.fullmatch(r"[0-9a-fA-F]{64}", file.sha256):
        raise DownloadError(f"the index publishes no sha256 for {file.filename}, so it cannot be checked; {ADVICE}")
    cached = cache / file.filename if cache is not None else None
    if cached is not None and cached.is_file() and cached.stat().st_size <= MAX_SDIST:
        data = cached.read_bytes()
        if hashlib.sha256(data).hexdigest() == file.sha256.lower():
            return data
    got = _read(file.url, settings, MAX_SDIST)
    if got is None:
        raise DownloadError(f"{file.url.rpartition('@')[2]} is listed by the index but not there; {ADVICE}")
    if hashlib.sha256(got[0]).hexdigest() != file.sha256.lower():
        raise DownloadError(f"{file.filename}: its sha256 does not match the one the index publishes; refusing it")
    return got[0]
