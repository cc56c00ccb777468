"""A repository cannot make the host run code from a distribution it names: requirements are fetched on the host, but
only wheels go through pip there; a requirement published only as a source distribution is fetched as a file and
read statically, and it builds inside the sandbox.

Everything is offline: a tiny package index (PEP 691 JSON and PEP 503 HTML pages, files with their sha256) is served on
127.0.0.1 from a thread, and pip is pointed at it through its own configuration (`PIP_INDEX_URL`, no pip.conf). Each
source distribution carries an in-tree PEP 517 backend with no build requirements, so pip would run it at once: every
hook appends a line to a marker file on the host — which must never appear — and the wheel it builds records the
interpreter that built it (`/workspace/.venv/bin/python` inside the sandbox).

The index:
- `evilsdist` 0.9, 1.0, 1.5 (yanked), 1.8 (Requires-Python >= 4), 2.0: sdists only; the repo asks for `>= 0.9, < 2`, so
  1.0 is the one; its PKG-INFO declares (Metadata-Version 2.2) `Requires-Dist: tinywheel >= 1.0`;
- `tinywheel` 1.0: a wheel and an sdist (the wheel must be used);
- `wheelparent` 1.0: a wheel that requires `Deep.Sdist` — a dependency published only as an sdist, one level down;
- `deep_sdist` 1.0: an sdist (HTML page only) whose PKG-INFO (Metadata-Version 2.1) lists no dependencies: the
  `deep_sdist.egg-info/requires.txt` setuptools packs names `tinywheel`, taken as a hint;
- `badhash` (an sdist whose published sha256 is wrong) and `liar` (an sdist whose PKG-INFO names another project).
"""

import base64
import hashlib
import html
import http.server
import io
import json
import os
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from servers import needs_sandbox

from shipyard.tasks.downloads import (
    Downloader,
    DownloadError,
    IndexFile,
    choose_sdist,
    egg_requires,
    pip_settings,
    sdist_metadata,
)
from shipyard.tasks.environment import prepare

BACKEND = r'''
import base64
import hashlib
import sys
import zipfile
from pathlib import Path

INFO = f"{NAME}-{VERSION}.dist-info"


def _mark():
    try:
        with open(MARKER, "a") as f:
            f.write(f"{NAME} {VERSION} ran with {sys.executable}\n")
    except OSError:  # inside the sandbox the host's directory is not there
        pass


def _metadata():
    return f"Metadata-Version: 2.2\nName: {NAME}\nVersion: {VERSION}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in REQUIRES)


def get_requires_for_build_wheel(config_settings=None):
    _mark()
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _mark()
    (Path(metadata_directory) / INFO).mkdir()
    (Path(metadata_directory) / INFO / "METADATA").write_text(_metadata())
    return INFO


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _mark()
    wheel = "Wheel-Version: 1.0\nGenerator: sdist-backend\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files = {f"{NAME}.py": f"BUILT_BY = {sys.executable!r}\n", f"{INFO}/METADATA": _metadata(), f"{INFO}/WHEEL": wheel}
    record = ""
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(text.encode())}\n"
    files[f"{INFO}/RECORD"] = record + f"{INFO}/RECORD,,\n"
    name = f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(Path(wheel_directory) / name, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return name
'''


def wheel_file(name: str, version: str, requires: tuple[str, ...] = ()) -> tuple[str, bytes]:
    """A pure-Python wheel of `name` (generator `test-wheel`): its file name and bytes."""
    info = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n"
                                                                                  for r in requires)
    files = {f"{name}.py": f"VERSION = {version!r}\n", f"{info}/METADATA": meta,
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test-wheel\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = ""
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(text.encode())}\n"
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


def sdist_file(name: str, version: str, marker: Path, requires: tuple[str, ...] = (), metadata_version: str = "2.2",
               declared: bool = True, egg_requires: str | None = None) -> tuple[str, bytes]:
    """A source distribution whose in-tree backend marks the host if it runs there (module docstring)."""
    top = f"{name}-{version}"
    pkg_info = f"Metadata-Version: {metadata_version}\nName: {name}\nVersion: {version}\n"
    if declared:
        pkg_info += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{top}/PKG-INFO": pkg_info,
             f"{top}/pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\n'
                                      'backend-path = ["."]\n',
             f"{top}/backend.py": f"NAME, VERSION, REQUIRES, MARKER = {name!r}, {version!r}, {list(requires)!r}, "
                                  f"{str(marker)!r}\n" + BACKEND}
    if egg_requires is not None:
        files[f"{top}/{name}.egg-info/requires.txt"] = egg_requires
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, text in files.items():
            data = text.encode()
            member = tarfile.TarInfo(path)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return f"{top}.tar.gz", buf.getvalue()


class Index:
    """A package index on 127.0.0.1, served from a thread until `close` (or 5 minutes, whichever comes first)."""

    def __init__(self, projects: dict[str, list[dict]], files: dict[str, bytes], html_only: set[str]):
        self.projects, self.files, self.html_only = projects, files, html_only
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                index.requests.append(self.path)
                body, kind = index.answer(self.path, self.headers.get("Accept", ""))
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()
        self.timer = threading.Timer(300, self.server.shutdown)
        self.timer.daemon = True
        self.timer.start()

    def answer(self, path: str, accept: str) -> tuple[bytes | None, str]:
        parts = path.split("?")[0].strip("/").split("/")
        if parts[0] == "files" and len(parts) == 2 and parts[1] in self.files:
            return self.files[parts[1]], "application/octet-stream"
        if parts[0] != "simple" or len(parts) != 2 or parts[1] not in self.projects:
            return None, "text/plain"
        entries = self.projects[parts[1]]
        if "application/vnd.pypi.simple.v1+json" in accept and parts[1] not in self.html_only:
            files = [{"filename": e["filename"], "url": f"../../files/{e['filename']}",
                      "hashes": {"sha256": e["sha256"]}, "requires-python": e.get("requires_python"),
                      "yanked": e.get("yanked", False)} for e in entries]
            return (json.dumps({"meta": {"api-version": "1.0"}, "name": parts[1], "files": files}).encode(),
                    "application/vnd.pypi.simple.v1+json")
        links = "".join(
            f'<a href="../../files/{e["filename"]}#sha256={e["sha256"]}"'
            + (f' data-requires-python="{html.escape(e["requires_python"])}"' if e.get("requires_python") else "")
            + (' data-yanked=""' if e.get("yanked") else "") + f'>{e["filename"]}</a>\n' for e in entries)
        return f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode(), "text/html"

    def close(self) -> None:
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()


def make_index(marker: Path) -> Index:
    """The index of the module docstring."""
    projects: dict[str, list[dict]] = {}
    files: dict[str, bytes] = {}

    def add(project: str, made: tuple[str, bytes], **extra) -> None:
        filename, data = made
        files[filename] = data
        projects.setdefault(project, []).append({"filename": filename, "sha256": hashlib.sha256(data).hexdigest(),
                                                 **extra})

    for version in ("0.9", "1.0", "2.0"):
        add("evilsdist", sdist_file("evilsdist", version, marker, ("tinywheel >= 1.0",)))
    add("evilsdist", sdist_file("evilsdist", "1.5", marker, ("tinywheel >= 1.0",)), yanked=True)
    add("evilsdist", sdist_file("evilsdist", "1.8", marker, ("tinywheel >= 1.0",)), requires_python=">=4")
    add("tinywheel", wheel_file("tinywheel", "1.0"))
    add("tinywheel", sdist_file("tinywheel", "1.0", marker))
    add("wheelparent", wheel_file("wheelparent", "1.0", ("Deep.Sdist",)))
    add("deep-sdist", sdist_file("deep_sdist", "1.0", marker, ("tinywheel",), metadata_version="2.1", declared=False,
                                 egg_requires="tinywheel\n\n[fast]\nnothing-such\n"))
    add("badhash", sdist_file("badhash", "1.0", marker), sha256="0" * 64)
    add("liar", ("liar-1.0.tar.gz", sdist_file("evilsdist", "1.0", marker)[1]))
    return Index(projects, files, html_only={"deep-sdist"})


@pytest.fixture
def offline_pip(monkeypatch):
    """pip's configuration reduced to what a test sets: no pip.conf, no find-links, no extra index."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def index(tmp_path):
    served = make_index(tmp_path / "host-marker")
    yield served
    served.close()


DEMO_PYPROJECT = """[build-system]
requires = ["setuptools>=40.8"]
build-backend = "setuptools.build_meta"

[project]
name = "demo"
version = "0.1"

[project.optional-dependencies]
test = ["evilsdist >= 0.9, < 2", "wheelparent"]

[tool.setuptools]
packages = ["demo"]
"""


def demo_repo(root: Path) -> Path:
    repo = root / "demo"
    (repo / "demo").mkdir(parents=True)
    (repo / "demo" / "__init__.py").write_text("def answer():\n    return 42\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_demo.py").write_text("from demo import answer\n\n\ndef test_answer():\n"
                                                 "    assert answer() == 42\n")
    (repo / "pyproject.toml").write_text(DEMO_PYPROJECT)
    return repo


def dist_info(site: Path, name: str) -> Path:
    (found,) = site.glob(f"{name}-*.dist-info")
    return found


@needs_sandbox
def test_sdists_never_run_on_the_host_and_build_in_the_sandbox(tmp_path, index, offline_pip):
    offline_pip.setenv("PIP_INDEX_URL", index.url)
    marker = tmp_path / "host-marker"
    prepared = prepare(demo_repo(tmp_path), tmp_path / "prepared", tmp_path / "wheel-cache", timeout=300)
    assert not marker.exists(), f"code from a downloaded distribution ran on the host:\n{marker.read_text()}"
    site = next((prepared.root / ".venv" / "lib").glob("python*/site-packages"))
    # built from its sdist inside the sandbox, by the venv's interpreter there
    assert (site / "evilsdist.py").read_text() == "BUILT_BY = '/workspace/.venv/bin/python'\n"
    assert dist_info(site, "evilsdist").name == "evilsdist-1.0.dist-info"
    assert (site / "deep_sdist.py").read_text() == "BUILT_BY = '/workspace/.venv/bin/python'\n"
    # a requirement with a wheel still comes as that wheel, never built from its sdist
    assert "Generator: test-wheel" in (dist_info(site, "tinywheel") / "WHEEL").read_text()
    assert "Generator: test-wheel" in (dist_info(site, "wheelparent") / "WHEEL").read_text()
    assert "/files/tinywheel-1.0-py3-none-any.whl" in index.requests  # pip downloaded it from the configured index


def test_wheels_come_through_pip_and_sdists_as_files_never_run(tmp_path, index, offline_pip):
    offline_pip.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing there: the explicit index wins
    wheelhouse, cache = tmp_path / "wheelhouse", tmp_path / "cache"
    with Downloader(wheelhouse, cache, index_url=index.url) as downloader:
        sdists = downloader.fetch(["evilsdist >= 0.9, < 2", "wheelparent"])
    assert not (tmp_path / "host-marker").exists()
    got = sorted(p.name for p in wheelhouse.iterdir())
    assert got == ["deep_sdist-1.0.tar.gz", "evilsdist-1.0.tar.gz", "tinywheel-1.0-py3-none-any.whl",
                   "wheelparent-1.0-py3-none-any.whl"]  # no stub, no other version, tinywheel's wheel not its sdist
    assert sorted(p.name for p in cache.iterdir()) == got
    evil, deep = sorted(sdists, key=lambda s: s.name != "evilsdist")
    assert (evil.name, evil.version, evil.requires, evil.declared, evil.build_requires) == \
        ("evilsdist", "1.0", ["tinywheel>=1.0"], True, [])
    assert (deep.name, deep.declared) == ("deep-sdist", False)
    assert deep.requires == ["tinywheel", 'nothing-such; extra == "fast"'] and deep.extras == ["fast"]
    assert "/simple/tinywheel/" in index.requests and "/files/tinywheel-1.0-py3-none-any.whl" in index.requests
    assert not [r for r in index.requests if r.endswith(("tinywheel-1.0.tar.gz", "evilsdist-2.0.tar.gz"))]


@pytest.mark.parametrize("requirement, message", [
    ("badhash", "badhash-1.0.tar.gz: its sha256 does not match the one the index publishes"),
    ("liar", "liar-1.0.tar.gz's PKG-INFO names 'evilsdist'"),
    ("no-such-project", "no-such-project is on none of the indexes"),
    ("evilsdist > 5", "evilsdist>5 has no wheel for this platform .*, and no source distribution of a version it "
                      "allows either"),
    ("evilsdist @ http://127.0.0.1:9/evilsdist-1.0.tar.gz", "names a URL; only the index is fetched from"),
])
def test_what_cannot_be_fetched_safely_is_a_clear_error(tmp_path, index, offline_pip, requirement, message):
    offline_pip.setenv("PIP_INDEX_URL", index.url)
    with Downloader(tmp_path / "wheelhouse", tmp_path / "cache") as downloader, \
            pytest.raises(DownloadError, match=message) as caught:
        downloader.fetch([requirement])
    assert "install it on this host first" in str(caught.value) or "refusing" in str(caught.value)
    assert not (tmp_path / "host-marker").exists()


def test_no_index_configured_names_the_requirement(tmp_path, index, offline_pip):
    offline_pip.setenv("PIP_INDEX_URL", index.url)
    offline_pip.setenv("PIP_NO_INDEX", "1")
    assert pip_settings(None).indexes == []
    with Downloader(tmp_path / "wheelhouse", tmp_path / "cache") as downloader, \
            pytest.raises(DownloadError, match=r"evilsdist has no wheel .* no index \(no-index\)"):
        downloader.fetch(["evilsdist"])


def test_pip_configuration_decides_the_indexes(offline_pip):
    offline_pip.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/first")
    offline_pip.setenv("PIP_EXTRA_INDEX_URL", "http://127.0.0.1:9/second file:///srv/third")
    assert pip_settings(None).indexes == ["http://127.0.0.1:9/first", "http://127.0.0.1:9/second",
                                          "file:///srv/third"]
    assert pip_settings("http://127.0.0.1:9/mine").indexes[0] == "http://127.0.0.1:9/mine"
    offline_pip.delenv("PIP_INDEX_URL")
    offline_pip.delenv("PIP_EXTRA_INDEX_URL")
    assert pip_settings(None).indexes == ["https://pypi.org/simple"]


def test_the_newest_allowed_release_is_chosen():
    files = [IndexFile(name, f"https://x/{name}", "0" * 64, requires_python, yanked) for name, requires_python, yanked
             in [("Big_O-0.9.tar.gz", None, False), ("big-o-1.0.zip", None, False), ("big_o-1.0.tar.gz", None, False),
                 ("big_o-1.1.tar.gz", None, True), ("big_o-1.2.tar.gz", ">=4", False), ("big_o-2.0rc1.tar.gz", None,
                                                                                        False),
                 ("big_o-0.8-py3-none-any.whl", None, False), ("other-1.5.tar.gz", None, False)]]
    version, file = choose_sdist(files, Requirement("big-O"))
    assert (str(version), file.filename) == ("1.0", "big_o-1.0.tar.gz")  # yanked, Requires-Python, prerelease out
    assert str(choose_sdist(files, Requirement("big-O == 1.1"))[0]) == "1.1"  # a yanked release, pinned
    assert str(choose_sdist(files, Requirement("big-O >= 2.0rc1"))[0]) == "2.0rc1"
    assert choose_sdist(files, Requirement("big-O < 0.9")) is None


def test_metadata_is_read_statically_and_declared_only_under_pep_643(tmp_path):
    def meta(version: str, headers: str, egg: str | None = None):
        top = f"pkg-{version}"
        members = {f"{top}/PKG-INFO": f"Name: pkg\nVersion: {version}\n{headers}",
                   f"{top}/pyproject.toml": '[build-system]\nrequires = ["flit_core >=3.2,<4"]\n'}
        if egg is not None:
            members[f"{top}/src/pkg.egg-info/requires.txt"] = egg
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for path, text in members.items():
                z.writestr(path, text)
        return sdist_metadata("pkg", Version(version), f"{top}.zip", buf.getvalue())

    declared = meta("1.0", "Metadata-Version: 2.2\nRequires-Dist: attrs>=20\nDynamic: Description\n")
    assert (declared.requires, declared.declared) == (["attrs>=20"], True)
    assert declared.build_requires == ["flit_core<4,>=3.2"]
    dynamic = meta("1.0", "Metadata-Version: 2.4\nDynamic: Requires-Dist\n", egg="attrs\n")
    assert (dynamic.requires, dynamic.declared) == (["attrs"], False)
    old = meta("2.0", "Metadata-Version: 2.1\n", egg='six\n\n[:python_version < "3.20"]\ntyping\n')
    assert (old.requires, old.declared) == (["six", 'typing; python_version < "3.20"'], False)
    with pytest.raises(DownloadError, match="requires evil by URL"):
        meta("1.0", "Metadata-Version: 2.2\nRequires-Dist: evil @ https://example.com/evil.tar.gz\n")


def test_setuptools_requires_txt_sections():
    assert egg_requires('a>=1\n\n[fast]\nb\n\n[fast:sys_platform == "win32"]\nc\n\n[:python_version<"3"]\nd\n') == [
        "a>=1", 'b ; extra == "fast"', 'c ; (sys_platform == "win32") and extra == "fast"',
        'd ; (python_version<"3")']
