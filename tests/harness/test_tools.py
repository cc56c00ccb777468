from pathlib import Path

import pytest
from wsutil import get, put, sh

from shipyard.harness.tools import ToolContext, ToolError
from shipyard.harness.tools.base import truncate_middle
from shipyard.harness.tools.edit import delete_file, search_replace, syntax_error, write_file
from shipyard.harness.tools.files import glob, grep, list_dir, read_file
from shipyard.harness.tools.lint import read_lints
from shipyard.harness.tools.todo import todo_write
from shipyard.harness.workspace import PathError


@pytest.fixture
def ctx(ws):
    c = ToolContext(ws)
    yield c
    c.close()


# Confinement ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "pocketlib/../../x", "..", "a/../../b"])
def test_paths_outside_are_refused(ctx, path):
    with pytest.raises(PathError, match="outside the workspace"):
        read_file(ctx, path)
    with pytest.raises(PathError):
        write_file(ctx, path, "x")


def test_symlink_escape_refused(ctx, ws):
    sh(ws, "ln -s /etc/passwd link.txt && ln -s /etc linkdir")
    with pytest.raises(PathError, match="symbolic link"):
        read_file(ctx, "link.txt")
    with pytest.raises(PathError):
        write_file(ctx, "linkdir/new.txt", "x")
    assert not Path("/etc/new.txt").exists()
    assert "link.txt" not in glob(ctx, "**/*.txt")


def test_absolute_path_inside_is_accepted(ctx, ws):
    assert "def to_roman" in read_file(ctx, f"{ws.exec_root}/pocketlib/roman.py")


def test_empty_path(ctx):
    with pytest.raises(PathError, match="non-empty"):
        read_file(ctx, " ")


# Reading ----------------------------------------------------------------------------------------------------
def test_read_file_numbers_and_pages(ctx):
    out = read_file(ctx, "pocketlib/roman.py", offset=3, limit=2)
    lines = out.splitlines()
    assert lines[0].split("\t")[0].strip() == "3"
    assert "call read_file with offset=5 to continue" in lines[-1]


def test_read_file_errors(ctx, ws):
    with pytest.raises(ToolError, match="does not exist"):
        read_file(ctx, "nope.py")
    with pytest.raises(ToolError, match="directory"):
        read_file(ctx, "pocketlib")
    with pytest.raises(ToolError, match="past the end"):
        read_file(ctx, "pocketlib/__init__.py", offset=999)
    put(ws, "blob.bin", b"\x00\x01\x02")
    assert "binary file" in read_file(ctx, "blob.bin")
    put(ws, "empty.txt", "")
    assert "is empty" in read_file(ctx, "empty.txt")


def test_list_dir(ctx):
    out = list_dir(ctx)
    assert "pocketlib/" in out and "tests/" in out and "README.md" in out
    with pytest.raises(ToolError, match="not a directory"):
        list_dir(ctx, "README.md")


def test_glob(ctx):
    out = glob(ctx, "**/test_*.py")
    assert "tests/test_roman.py" in out.splitlines()
    assert "no paths match" in glob(ctx, "*.rs")
    with pytest.raises(ToolError):
        glob(ctx, "../*")


def test_grep(ctx):
    out = grep(ctx, r"def (to|from)_roman", glob="*.py")
    assert "pocketlib/roman.py:" in out and "from_roman" in out
    assert "no matches" in grep(ctx, "zzz_not_there_zzz")
    with pytest.raises(ToolError, match="grep failed"):
        grep(ctx, "(unclosed")
    lines = lambda out: [int(hit.split(":")[1]) for hit in out.splitlines()]  # noqa: E731
    assert lines(grep(ctx, "roman", path="pocketlib/roman.py")) == [10, 24, 34, 39, 42]
    # ignore_case also finds the docstrings' and the message's "Roman"
    assert lines(grep(ctx, "roman", path="pocketlib/roman.py", ignore_case=True)) == [1, 10, 11, 24, 25, 34, 35, 39,
                                                                                        40, 42]


# Editing ----------------------------------------------------------------------------------------------------
def test_search_replace_unique(ctx, ws):
    out = search_replace(ctx, "pocketlib/stats.py", "return math.fsum(values) / len(values)",
                         "return math.fsum(values) / float(len(values))")
    assert out.startswith("edited 'pocketlib/stats.py'")
    assert "float(len(values))" in get(ws, "pocketlib/stats.py")


def test_search_replace_ambiguous_and_replace_all(ctx, ws):
    with pytest.raises(ToolError, match=r"occurs \d+ times .*lines"):
        search_replace(ctx, "pocketlib/stats.py", "_require(values)\n", "_require(values)  # checked\n")
    search_replace(ctx, "pocketlib/stats.py", "_require(values)\n", "_require(values)  # checked\n",
                   replace_all=True)
    assert get(ws, "pocketlib/stats.py").count("# checked") == 5


def test_search_replace_not_found_suggests_closest_line(ctx):
    with pytest.raises(ToolError, match=r"closest line is 17: .*math.fsum\(values\) / len"):
        search_replace(ctx, "pocketlib/stats.py", "return math.fsum(values)/len(values)", "return 0")


def test_syntax_gate_rejects_and_keeps_file(ctx, ws):
    before = get(ws, "pocketlib/stats.py")
    with pytest.raises(ToolError, match=r"syntax error — SyntaxError: .*line \d+"):
        search_replace(ctx, "pocketlib/stats.py", "def mean(values", "def mean(values,,")
    assert get(ws, "pocketlib/stats.py") == before
    with pytest.raises(ToolError, match="JSONDecodeError"):
        write_file(ctx, "data.json", '{"a": }')


def test_syntax_gate_allows_fixing_a_broken_file(ctx, ws):
    put(ws, "broken.py", "def f(:\n    pass\n")
    out = search_replace(ctx, "broken.py", "pass", "return 1")
    assert "still does not parse" in out
    assert "still" not in search_replace(ctx, "broken.py", "def f(:", "def f():")


def test_syntax_error_helper():
    assert syntax_error("a.py", "x = 1\n") is None
    assert syntax_error("a.txt", "def (") is None
    assert "line 1" in syntax_error("a.py", "def (")
    assert syntax_error("a.toml", "x = ").startswith("TOMLDecodeError: ")  # the rest is tomllib's, by version


def test_search_replace_crlf(ctx, ws):
    put(ws, "win.py", b"a = 1\r\nb = 2\r\n")
    search_replace(ctx, "win.py", "a = 1\nb = 2", "a = 1\nb = 3")
    assert ws.read_bytes("win.py") == b"a = 1\r\nb = 3\r\n"


def test_search_replace_argument_errors(ctx):
    with pytest.raises(ToolError, match="empty"):
        search_replace(ctx, "pocketlib/stats.py", "", "x")
    with pytest.raises(ToolError, match="identical"):
        search_replace(ctx, "pocketlib/stats.py", "mean", "mean")
    with pytest.raises(ToolError, match="write_file"):
        search_replace(ctx, "new.py", "a", "b")


def test_write_and_delete(ctx, ws):
    assert write_file(ctx, "pkg/sub/new.py", "x = 1\n").startswith("created")
    assert write_file(ctx, "pkg/sub/new.py", "x = 2\n").startswith("overwrote")
    assert get(ws, "pkg/sub/new.py") == "x = 2\n"
    assert delete_file(ctx, "pkg/sub/new.py") == "deleted 'pkg/sub/new.py'."
    with pytest.raises(ToolError, match="does not exist"):
        delete_file(ctx, "pkg/sub/new.py")
    with pytest.raises(ToolError, match="directory"):
        delete_file(ctx, "pkg")
    with pytest.raises(ToolError, match="root"):
        delete_file(ctx, ".")


def test_read_lints(ctx, ws):
    assert "no lint errors" in read_lints(ctx, ["pocketlib/roman.py"])
    put(ws, "bad.py", "import os\n")
    out = read_lints(ctx)
    assert "bad.py:1:8: F401" in out


def test_todo_write(ctx):
    out = todo_write(ctx, [{"id": "1", "content": "read", "status": "completed"},
                           {"id": "2", "content": "fix", "status": "in_progress"}])
    assert "(1/2 done)" in out and "[x] 1: read" in out and "[~] 2: fix" in out
    with pytest.raises(ToolError, match="unique"):
        todo_write(ctx, [{"id": "1", "content": "a", "status": "pending"}] * 2)
    assert todo_write(ctx, []) == "todo list cleared."


def test_truncate_middle_states_dropped_bytes():
    text = "A" * 100 + "B" * 100
    out = truncate_middle(text, 50)
    assert out.startswith("A" * 25) and out.endswith("B" * 25) and "150 bytes dropped" in out
    assert truncate_middle("short", 50) == "short"


def test_workspace_diff(ws):
    put(ws, "pocketlib/roman.py", "changed\n")
    put(ws, "new.txt", "hello\n")
    ws.delete("README.md")
    sh(ws, "python -c 'import pocketlib.stats'")  # writes __pycache__, which no diff shows
    diff = ws.diff()
    assert "diff --git a/pocketlib/roman.py b/pocketlib/roman.py" in diff
    assert "diff --git a/new.txt b/new.txt" in diff and "+++ b/new.txt" in diff
    assert "diff --git a/README.md b/README.md" in diff and "--- a/README.md" in diff
    assert "__pycache__" not in diff


def test_workspace_requires_directory(tmp_path: Path):
    from shipyard.harness.workspace import LocalWorkspace

    with pytest.raises(FileNotFoundError):
        LocalWorkspace(tmp_path / "missing")
