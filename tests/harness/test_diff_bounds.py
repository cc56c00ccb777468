"""`tree_diff` over trees an agent shaped: special files are never opened, huge files never copied, the patch
never past its bound — and every change left out is named where a reader of the patch sees it, in a note that
`git apply` ignores."""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from shipyard.harness.workspace import MAX_FILE_BYTES, LocalWorkspace, tree_diff
from shipyard.tasks.grade import patch_paths


@pytest.fixture
def trees(tmp_path):
    before = tmp_path / "before"
    before.mkdir()
    (before / "app.py").write_text("x = 1\n")
    (before / "keep.txt").write_text("unchanged\n")
    after = tmp_path / "after"
    shutil.copytree(before, after)
    return before, after


def note_of(patch: str) -> list[str]:
    return [line for line in patch.splitlines() if line.startswith("#")]


def applies(patch: str, before: Path, tmp_path: Path) -> Path:
    target = tmp_path / "applied"
    shutil.copytree(before, target)
    (tmp_path / "patch.diff").write_text(patch)
    r = subprocess.run(["git", "apply", "--whitespace=nowarn", str(tmp_path / "patch.diff")], cwd=target,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return target


def test_special_and_huge_files_are_named_never_read(trees, tmp_path):
    before, after = trees
    (after / "app.py").write_text("x = 2\n")
    os.mkfifo(after / "pipe")  # opening it to copy would block for ever
    with open(after / "big.bin", "wb") as f:
        f.truncate(400 << 20)
    with socket.socket(socket.AF_UNIX) as s:  # bind by a short relative path: socket paths are limited to 108 bytes
        cwd = os.getcwd()
        os.chdir(after)
        try:
            s.bind("sock")
        finally:
            os.chdir(cwd)
        start = time.monotonic()
        patch = tree_diff(before, after)
    assert time.monotonic() - start < 5
    assert len(patch) < 2048
    note = note_of(patch)
    assert any(f'"big.bin": now a file of {400 << 20} bytes (over the {MAX_FILE_BYTES}-byte' in n for n in note)
    assert any('"pipe": now a FIFO; before: absent' in n for n in note)
    assert any('"sock": now a socket' in n for n in note)
    assert (applies(patch, before, tmp_path) / "app.py").read_text() == "x = 2\n"


def test_a_huge_file_replaced_or_deleted_is_named_unchanged_ones_are_not(trees, tmp_path):
    before, after = trees
    for tree in (before, after):
        with open(tree / "data.bin", "wb") as f:
            f.truncate(MAX_FILE_BYTES + 1)
        os.utime(tree / "data.bin", ns=(1, 1))
        with open(tree / "old.bin", "wb") as f:
            f.truncate(MAX_FILE_BYTES * 2)
    (after / "old.bin").unlink()
    (after / "app.py").write_text("x = 3\n")
    note = note_of(tree_diff(before, after))
    assert len(note) == 2 and '"old.bin": now absent; before: a file of' in note[1]


def test_the_patch_is_bounded_and_names_what_did_not_fit(trees, tmp_path):
    before, after = trees
    for name in ("a.txt", "b.txt", "c.txt"):
        (after / name).write_text(f"{name} line\n" * 1000)  # ~13 kB of diff each
    (after / "app.py").write_text("x = 4\n")
    patch = tree_diff(before, after, max_bytes=30_000)
    body = patch[patch.index("diff --git"):]
    assert len(body.encode()) <= 30_000
    assert patch_paths(patch) == ["a.txt", "app.py", "b.txt"]
    assert any('"c.txt": its diff of' in n and "does not fit in the patch's 30000" in n for n in note_of(patch))
    applied = applies(patch, before, tmp_path)
    assert (applied / "app.py").read_text() == "x = 4\n" and not (applied / "c.txt").exists()


def test_invalid_utf8_counts_at_its_decoded_size(trees):
    before, after = trees
    (after / "latin1.txt").write_bytes(b"caf\xe9\n" * 5000)  # each bad byte becomes a 3-byte U+FFFD
    patch = tree_diff(before, after, max_bytes=40_000)
    assert len(patch.encode()) < 41_000 and '"latin1.txt": its diff of' in patch


def test_names_in_the_note_cannot_forge_diff_headers(trees):
    before, after = trees
    (after / "x\ndiff --git a" / "p b").mkdir(parents=True)
    os.mkfifo(after / "x\ndiff --git a" / "p b" / "p\ny")  # written raw, its note line would hold a diff header
    patch = tree_diff(before, after)
    assert patch_paths(patch) == [] and len(note_of(patch)) == 2
    assert '"x\\ndiff --git a/p b/p\\ny": now a FIFO' in patch


def test_local_workspace_diff_survives_a_fifo(repo):
    ws = LocalWorkspace(repo)
    try:
        os.mkfifo(repo / "fifo")
        (repo / "README.md").write_text("changed\n")
        patch = ws.diff()
    finally:
        ws.close()
    assert "diff --git a/README.md b/README.md" in patch and '"fifo": now a FIFO' in patch


def test_local_workspace_opens_over_a_repo_holding_a_fifo(tmp_path):
    """The baseline copy skips special files (opening a FIFO blocks forever); the diff still works."""
    (tmp_path / "a.py").write_text("x = 1\n")
    os.mkfifo(tmp_path / "pipe")
    ws = LocalWorkspace(tmp_path)
    try:
        (tmp_path / "a.py").write_text("x = 2\n")
        assert "+x = 2" in ws.diff()
    finally:
        ws.close()


def test_what_a_test_run_writes_is_left_out_and_coverage_config_is_not(trees, tmp_path):
    """pytest-cov in a project's addopts writes `.coverage` (a binary database the grader would refuse) wherever the
    agent runs the tests: the patch holds the agent's change only. `.coveragerc` is configuration, not output: a
    change to it stays in the patch, where the grader refuses it."""
    before, after = trees
    (after / "app.py").write_text("x = 2\n")
    (after / ".coverage").write_bytes(b"SQLite format 3\x00" + bytes(range(256)))
    (after / "pkg").mkdir()
    (after / "pkg" / ".coverage.host.4242.XyZ").write_bytes(b"\x00\x01")
    (after / "coverage.xml").write_text("<coverage/>\n")
    (after / "htmlcov").mkdir()
    (after / "htmlcov" / "index.html").write_text("<html/>\n")
    (after / ".coveragerc").write_text("[run]\nomit = *\n")
    patch = tree_diff(before, after)
    assert sorted(patch_paths(patch)) == [".coveragerc", "app.py"]
    assert not note_of(patch)
    (before / "pkg").mkdir()  # a project's own package or fixture by such a name is diffed like any file
    (before / "pkg" / "htmlcov").mkdir()
    (before / "pkg" / "htmlcov" / "__init__.py").write_text("A = 1\n")
    (before / "coverage.xml").write_text("<fixture/>\n")
    shutil.copytree(before / "pkg" / "htmlcov", after / "pkg" / "htmlcov")
    (after / "pkg" / "htmlcov" / "__init__.py").write_text("A = 2\n")
    (after / "pkg" / "htmlcov" / ".coverage").write_bytes(b"\x00")
    assert sorted(patch_paths(tree_diff(before, after))) == [".coveragerc", "app.py", "coverage.xml",
                                                             "pkg/htmlcov/__init__.py"]
