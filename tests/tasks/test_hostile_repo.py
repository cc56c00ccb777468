"""Synthesis from a repository that is hostile input: links out of it, dangling and looping links, a FIFO, a build
script that litters the tree, and requirement strings full of shell syntax — end to end in real sandboxes.

The repo is the example repo plus:
- `tests/data/host.txt` → a file outside the repository holding a secret (must never reach the task set);
- `tests/test_dangling.py` → nothing (once made every task an error); `docs_link` → a directory; a link loop; a FIFO;
- `tests/data/readme_copy.md` → `../../README.md` (inside the repository: materialised as a copy);
- a test requirement `tinypkg >= 2.0, < 3.0 ; python_version >= "3"` that must be downloaded: pip is pointed at a
  directory of hand-built wheels (1.0, 2.0, 3.0) through its own environment variables, so no network is used; a
  test asserts 2.0 was installed (the shell once read `<` and `>` as redirections);
- a `setup.py` that, during the editable install, writes a `.py` file into the package (kept, like setuptools-scm's
  `_version.py`), an empty file `=9.9` and a new directory at the top (dropped), and a `.py` symlink to a host file
  into the package (dropped).
"""

import base64
import hashlib
import os
import shutil
import stat
import uuid
import zipfile
from pathlib import Path

import pytest
from servers import needs_sandbox

from shipyard.tasks.environment import copy_repository, regular_files
from shipyard.tasks.synth import SynthConfig, Synthesizer, empty_patch_reason
from shipyard.tasks.taskset import list_tasks, load_task, read_canonical

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pocketlib"

SETUP_PY = """from pathlib import Path
import os
from setuptools import setup

Path("pocketlib/_build_info.py").write_text("BUILT = True\\n")
Path("=9.9").write_text("")
Path("stray_dir").mkdir(exist_ok=True)
Path("stray_dir/stray.py").write_text("")
if not os.path.lexists("pocketlib/evil_link.py"):
    os.symlink("/etc/passwd", "pocketlib/evil_link.py")
setup(packages=["pocketlib"])
"""
TINY_TEST = """from importlib.metadata import version
from pathlib import Path


def test_bounded_requirement_installed():
    assert version("tinypkg") == "2.0"


def test_materialised_fixture():
    assert (Path(__file__).parent / "data" / "readme_copy.md").read_text().startswith("# pocketlib")
"""


def wheel(dest: Path, version: str) -> None:
    """A minimal pure-Python wheel of `tinypkg` (a zip with the dist-info pip reads)."""
    info = f"tinypkg-{version}.dist-info"
    files = {"tinypkg/__init__.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: tinypkg\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = ""
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record += f"{path},sha256={digest},{len(text.encode())}\n"
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(dest / f"tinypkg-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def hostile_repo(root: Path) -> tuple[Path, bytes]:
    """The repository described in the module docstring, and the secret its outward link points at."""
    secret = f"SHIPYARD-HOST-SECRET-{uuid.uuid4().hex}".encode()
    (root / "host-secret.txt").write_bytes(secret + b"\n")
    repo = root / "pocketlib"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__", ".ruff_cache", ".benchmarks"))
    pyproject = (repo / "pyproject.toml").read_text()
    (repo / "pyproject.toml").write_text(pyproject.replace(
        'requires-python = ">=3.10"\n',
        'requires-python = ">=3.10"\n\n[project.optional-dependencies]\n'
        "test = ['tinypkg >= 2.0, < 3.0 ; python_version >= \"3\"']\n", 1))
    (repo / "setup.py").write_text(SETUP_PY)
    (repo / "tests" / "test_tinypkg.py").write_text(TINY_TEST)
    (repo / "tests" / "data").mkdir()
    (repo / "tests" / "data" / "host.txt").symlink_to(root / "host-secret.txt")
    (repo / "tests" / "data" / "readme_copy.md").symlink_to("../../README.md")
    (repo / "tests" / "test_dangling.py").symlink_to("missing_tests.py")
    (repo / "docs_link").symlink_to("pocketlib")
    (repo / "loop_a").symlink_to("loop_b")
    (repo / "loop_b").symlink_to("loop_a")
    os.mkfifo(repo / "tests" / "fifo")
    return repo, secret


SKIPPED = {"tests/data/host.txt": "out of the repository", "tests/test_dangling.py": "dangling",
           "docs_link": "directory", "loop_a": "loop", "loop_b": "loop", "tests/fifo": "named pipe"}


def test_copy_keeps_regular_files_and_inner_links_only(tmp_path):
    repo, secret = hostile_repo(tmp_path)
    (repo / ".git").mkdir()
    (repo / ".git" / "config").write_text("[core]\n")
    (repo / "tests" / "data" / "git_link").symlink_to("../../.git/config")
    skipped = copy_repository(repo, tmp_path / "copy")
    assert {rel: why for rel, why in skipped.items() if rel != "tests/data/git_link"}.keys() == SKIPPED.keys()
    for rel, fragment in SKIPPED.items():
        assert fragment in skipped[rel], (rel, skipped[rel])
    assert ".git" in skipped["tests/data/git_link"]
    copied = tmp_path / "copy"
    expected = sorted({p.relative_to(repo).as_posix() for p in repo.rglob("*")
                       if p.is_file() and not p.is_symlink() and ".git" not in p.parts} | {"tests/data/readme_copy.md"})
    assert regular_files(copied) == expected
    assert not [p for p in copied.rglob("*") if p.is_symlink() or not (p.is_dir() or p.is_file())]
    assert (copied / "tests" / "data" / "readme_copy.md").read_bytes() == (repo / "README.md").read_bytes()
    assert stat.S_ISREG(os.lstat(copied / "tests" / "data" / "readme_copy.md").st_mode)
    assert not any(secret in (copied / rel).read_bytes() for rel in expected)


def test_an_infra_status_is_labelled_once():
    assert empty_patch_reason("infra_error") == "infra_error"
    assert empty_patch_reason("timeout") == "empty_patch_timeout"


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    repo, secret = hostile_repo(root)
    wheels = root / "wheelhouse"
    wheels.mkdir()
    for version in ("1.0", "2.0", "3.0"):
        wheel(wheels, version)
    out = root / "tasks"
    log: list[str] = []
    config = SynthConfig(max_tasks=2, tiers=(1,), suite_runs=1, oracle_runs=1, wheel_cache=root / "wheel-cache")
    with pytest.MonkeyPatch.context() as mp:  # pip's own configuration: no index, only these wheels
        mp.setenv("PIP_NO_INDEX", "1")
        mp.setenv("PIP_FIND_LINKS", str(wheels))
        report = Synthesizer(repo, out, config, log=log.append).run()
    return repo, out, report, log, secret


@needs_sandbox
def test_hostile_repo_still_makes_tasks(synthesized):
    repo, out, report, log, _ = synthesized
    assert report.accepted, (report.rejections, report.rejected)
    assert not [r for r in report.rejections if r.startswith("infra")], report.rejected
    assert report.skipped.keys() == SKIPPED.keys()
    assert [line for line in log if "left out" in line] == [next(line for line in log if "left out" in line)]
    assert report.generated == ["pocketlib/_build_info.py"]
    for task_id in list_tasks(out):
        task, task_dir = load_task(out, task_id)
        assert "tests/test_tinypkg.py::test_bounded_requirement_installed" in task.pass_to_pass
        assert "tests/test_tinypkg.py::test_materialised_fixture" in task.pass_to_pass
        assert "tests/data/readme_copy.md" in task.test_files
        assert read_canonical(task_dir, "tests/data/readme_copy.md") == (repo / "README.md").read_bytes()


@needs_sandbox
def test_nothing_from_outside_the_repo_reaches_the_task_set(synthesized):
    _, out, _, _, secret = synthesized
    for dirpath, dirnames, filenames in os.walk(out):  # os.walk never enters a linked directory
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            if path.is_symlink():
                assert ".venv" in path.relative_to(out).parts, f"{path} is a link outside the venv"
            elif path.is_file():
                assert secret not in path.read_bytes(), f"the host file's content reached {path}"


@needs_sandbox
def test_snapshots_hold_only_the_repos_files_and_the_venv(synthesized):
    repo, out, report, _, _ = synthesized
    expected = {p.relative_to(repo).as_posix() for p in repo.rglob("*") if p.is_file() and not p.is_symlink()}
    expected |= {"tests/data/readme_copy.md", *report.generated}
    for task_id in list_tasks(out):
        snapshot = out / task_id / "snapshot"
        got = set(regular_files(snapshot, skip={".venv", ".git"}))
        assert got == expected, (sorted(got - expected), sorted(expected - got))
        assert not [p for p in snapshot.iterdir() if p.name not in {".venv", ".git", *{e.split("/")[0]
                                                                                       for e in expected}}]
        site = next((snapshot / ".venv" / "lib").glob("python*/site-packages"))
        assert sorted(p.name for p in site.glob("tinypkg-*.dist-info")) == ["tinypkg-2.0.dist-info"]
