"""Hostile tool calls: every argument a model can send and every special file it can make must come back as a
tool error (`ToolError`/`PathError`) within the tool's time limit — never an exception that ends the episode,
never a hang, never a read or write outside the workspace, never unbounded host memory.

Most tests run twice (the `ws` fixture): on a local directory and in a real bubblewrap sandbox over a snapshot of
it, where the same `LocalWorkspace` code serves the calls inside the sandbox and the tools run on the host.
"""

from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from wsutil import get, put, sh

from shipyard.harness import workspace as workspace_module
from shipyard.harness.display import render_turn
from shipyard.harness.loop import Agent, LoopConfig, ToolExecutor
from shipyard.harness.parse import ToolCallParser
from shipyard.harness.tools import ToolContext, ToolError, default_tools
from shipyard.harness.tools.edit import delete_file, search_replace, write_file
from shipyard.harness.tools.files import glob, grep, list_dir, read_file
from shipyard.harness.tools.lint import read_lints
from shipyard.harness.tools.terminal import run_terminal
from shipyard.harness.trajectory import ERROR_KINDS, Trajectory
from shipyard.harness.workspace import MAX_FILE_BYTES, LocalWorkspace, PathError
from shipyard.models.replay import ReplayEngine

REFUSED = (ToolError, PathError)
NUL_PATH = "the path contains a NUL byte, which no file name can hold."
SURROGATE_PATH = ("the path contains '\\ud800', a lone surrogate that no file name can hold; write the name in "
                  "plain UTF-8.")


@pytest.fixture
def ctx(ws):
    c = ToolContext(ws)
    yield c
    c.close()


@pytest.fixture
def outside(ws, tmp_path):
    """A directory outside the workspace that processes in the workspace can write: next to the local checkout, or
    in the sandbox's private /tmp."""
    if isinstance(ws, LocalWorkspace):
        path = tmp_path / "outside"
        path.mkdir()
        return str(path)
    path = f"/tmp/outside-{uuid.uuid4().hex[:8]}"
    sh(ws, f"mkdir -p {path}")
    return path


def bounded(fn, *args, seconds: float = 15, **kwargs):
    """Call fn in a thread; fail the test (instead of hanging it) if it has not returned within `seconds`.
    Returns the result, or the exception it raised."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the test
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__}{args!r:.100} still running after {seconds} s"
    return box.get("error", box.get("result"))


def refused(fn, *args, match: str | None = None, seconds: float = 15, **kwargs) -> str:
    """The call must fail with a message for the model (ToolError/PathError), in time; returns the message."""
    outcome = bounded(fn, *args, seconds=seconds, **kwargs)
    # either class is the contract (what the model is told); `match` checks the message itself
    assert isinstance(outcome, REFUSED), f"{fn.__name__}{args!r:.100} gave {type(outcome).__name__}: {outcome!r:.300}"
    if match is not None:
        assert match.lower() in str(outcome).lower(), str(outcome)
    return str(outcome)


def answered(fn, *args, seconds: float = 15, **kwargs) -> str:
    """The call must succeed (return text), in time; callers check the text."""
    outcome = bounded(fn, *args, seconds=seconds, **kwargs)
    assert isinstance(outcome, str), f"{fn.__name__}{args!r:.100} gave {type(outcome).__name__}: {outcome!r:.300}"
    return outcome


# Arguments ---------------------------------------------------------------------------------------------------
def test_nul_bytes_in_any_argument_are_tool_errors(ctx):
    refused(grep, ctx, "a\x00b", match="NUL")
    refused(grep, ctx, "x", glob="*\x00.py", match="NUL")
    refused(grep, ctx, "x", path="po\x00cketlib", match=NUL_PATH)
    refused(run_terminal, ctx, "echo a\x00b", match="NUL")
    refused(run_terminal, ctx, "echo a\x00b", background=True, match="NUL")
    refused(glob, ctx, "*\x00.py", match="NUL")
    refused(glob, ctx, "*.py", path="a\x00", match=NUL_PATH)
    for tool, extra in ((read_file, {}), (list_dir, {}), (write_file, {"content": "x"}), (delete_file, {}),
                        (search_replace, {"old_string": "a", "new_string": "b"})):
        refused(tool, ctx, "README.md\x00", match=NUL_PATH, **extra)
    refused(read_lints, ctx, ["pocketlib\x00"], match=NUL_PATH)
    assert "[exit code 0]" in answered(run_terminal, ctx, "true")  # the session survived


def test_unencodable_strings_are_tool_errors(ctx):
    """A JSON string may hold a lone surrogate ("\\ud800"); no file name or argv can carry it."""
    for tool, extra in ((read_file, {}), (list_dir, {}), (write_file, {"content": "x"}), (delete_file, {}),
                        (search_replace, {"old_string": "a", "new_string": "b"})):
        refused(tool, ctx, "a\ud800.py", match=SURROGATE_PATH, **extra)
    text = "a lone surrogate that is not valid UTF-8; write plain UTF-8 text."
    refused(grep, ctx, "\ud800", match="the pattern contains '\\ud800', " + text)
    refused(run_terminal, ctx, "echo \ud800", match="the command contains '\\ud800', " + text)
    refused(write_file, ctx, "ok.txt", "text \ud800",
            match="the new text for 'ok.txt' contains '\\ud800', a lone surrogate that is not valid UTF-8; nothing was "
                  "written.")
    refused(read_lints, ctx, ["\ud800"], match=SURROGATE_PATH)
    refused(glob, ctx, "*\ud800", match="the pattern contains '\\ud800', " + text)


@pytest.mark.parametrize("path", ["a" * 5000, "x/" * 3000 + "f.py", "n" * 300 + ".py", "d/" + "n" * 300 + "/f.py"])
def test_overlong_paths_are_tool_errors(ctx, path):
    refused(read_file, ctx, path, match="too long")
    refused(write_file, ctx, path, "x", match="too long")
    refused(glob, ctx, "*", path=path, match="too long")


def test_paths_with_newlines_and_undecodable_bytes_work(ctx, ws):
    assert answered(write_file, ctx, "two\nlines.txt", "hello\n").startswith("created")
    assert "hello" in answered(read_file, ctx, "two\nlines.txt")
    assert '"two\\nlines.txt"' in answered(glob, ctx, "*.txt")  # quoted: one path per line stays unambiguous
    assert '"two\\nlines.txt"' in answered(list_dir, ctx)
    sh(ws, "printf x > $'bad\\xff.txt'")
    answered(list_dir, ctx)
    answered(glob, ctx, "*")


NO_MATCH = "no paths match '{}' under '.'."


@pytest.mark.parametrize(("pattern", "expected"), [
    *((p, NO_MATCH) for p in ("**a", "a**", "a//b", "[", "[!", "[]", "]", "\\")),
    ("***", "*"), ("**/**", "**/"), ("./**/*.py", "**/*.py"), ("pocketlib/**/**/*.py", "pocketlib/**/*.py"),
    ("*" * 5000, PathError("the pattern is too long (5000 bytes; a path is at most 4095 bytes).")),
    (" ", ToolError("the pattern is empty; e.g. '**/*.py' or 'tests/test_*.py'.")),
    ("**" * 500, PathError("the pattern has a name that is too long (1000 bytes; one file or directory name is at "
                           "most 255 bytes).")),
    ("*/" * 2000, PathError("the pattern has 2000 path segments; at most 64.")),
], ids=lambda v: repr(v)[:20] if isinstance(v, str) else type(v).__name__)
def test_any_glob_pattern_is_an_answer_or_a_tool_error(ctx, pattern, expected):
    outcome = bounded(glob, ctx, pattern, seconds=10)
    if isinstance(expected, Exception):
        assert (type(outcome), str(outcome)) == (type(expected), str(expected))
    elif expected == NO_MATCH:
        assert outcome == NO_MATCH.format(pattern)
    else:  # the answer of the plain pattern it means
        same = answered(glob, ctx, expected)
        assert outcome == same and not same.startswith("no paths match"), (outcome, same)


def test_glob_semantics_are_kept(ctx):
    assert refused(glob, ctx, "", match="empty")
    py = answered(glob, ctx, "**/*.py").splitlines()
    assert "pocketlib/roman.py" in py and "tests/test_roman.py" in py
    assert answered(glob, ctx, "**/**/**/*.py").splitlines() == py
    assert answered(glob, ctx, "./**/*.py").splitlines() == py
    assert answered(glob, ctx, "**r*.py", path="pocketlib") == answered(glob, ctx, "*r*.py", path="pocketlib")
    assert answered(glob, ctx, "tests/test_*.py").splitlines() == [p for p in py if p.startswith("tests/test_")]
    assert answered(glob, ctx, "*.py", path="pocketlib") == answered(glob, ctx, "pocketlib/*.py")
    dirs = answered(glob, ctx, "**/").splitlines()
    assert "pocketlib" in dirs and "tests" in dirs and "pocketlib/roman.py" not in dirs
    assert "pocketlib/roman.py" in answered(glob, ctx, "pocketlib/ro?an.[p]y")


# Bounded work ------------------------------------------------------------------------------------------------
def _tree(ws, depth: int) -> None:
    """A full ternary tree of directories `depth` deep (1093 dirs for 6), one .py file in each."""
    braces = "/".join(["d{0,1,2}"] * depth)
    sh(ws, f"mkdir -p t/{braces} && find t -type d -exec sh -c 'for d; do : > \"$d/m.py\"; done' sh {{}} +")


def test_repeated_double_star_is_not_exponential(ctx, ws):
    _tree(ws, 6)
    start = time.monotonic()
    plain = answered(glob, ctx, "**/*.py", path="t")
    chained = answered(glob, ctx, "**/" * 8 + "*.py", path="t", seconds=30)
    assert chained == plain
    assert time.monotonic() - start < 5


def test_glob_stops_at_its_entry_budget_with_a_message(workspace, monkeypatch):
    ctx = ToolContext(workspace)
    _tree(workspace, 5)
    monkeypatch.setattr(workspace_module, "MAX_GLOB_ENTRIES", 100)
    refused(glob, ctx, "**/*.py", match="narrow")
    monkeypatch.setattr(workspace_module, "MAX_GLOB_ENTRIES", 100_000)
    assert "more matches; narrow the pattern" in answered(glob, ctx, "**/m.py", path="t")  # capped by the tool


def test_deep_trees(ctx, ws):
    """1100 levels (deeper than Python's recursion limit), and 2100 levels (longer than PATH_MAX)."""
    shallow = ws.files(50)  # the example's 15 files
    for name, depth, file in (("d", 1100, "deep.py"), ("dd", 2100, "deeper.py")):  # one process: forks are slow
        sh(ws, f"python -c 'import os\nfor _ in range({depth}): os.mkdir(\"{name}\"); os.chdir(\"{name}\")\n"
               f"open(\"{file}\", \"w\").write(\"x = 1\")'")
    try:
        deep = "d/" * 1100 + "deep.py"
        assert answered(glob, ctx, "**/deep.py") == deep
        answered(glob, ctx, "**/deeper.py", seconds=30)
        assert "x = 1" in answered(read_file, ctx, deep)
        refused(read_file, ctx, "dd/" * 2100 + "deeper.py", match="too long")
        assert "d/" in answered(list_dir, ctx, "d/" * 1000)
        files = bounded(ws.files, 50)  # deeper.py, past PATH_MAX, is left out
        assert len(shallow) == 15 and files == shallow + ["d/" * 1100 + "deep.py"]  # breadth first
    finally:
        sh(ws, "rm -rf d dd")


def test_search_replace_work_is_bounded(ctx, ws):
    put(ws, "many.txt", "a = 1\n" * 200_000)
    message = refused(search_replace, ctx, "many.txt", "a = 1", "b = 2", match="200000 times", seconds=10)
    assert len(message) < 2000
    refused(search_replace, ctx, "many.txt", "a", "x" * 1000, replace_all=True, match="bytes", seconds=10)
    assert get(ws, "many.txt") == "a = 1\n" * 200_000
    put(ws, "similar.txt", "".join(f"value_{i} = compute_something_long({i}, {'x' * 150})\n" for i in range(40_000)))
    refused(search_replace, ctx, "similar.txt", "value_x = compute_something_long(0, xxx)", "y", match="not found",
            seconds=10)


@pytest.mark.parametrize(("name", "content"), [("deep.py", "x = " + "1+" * 100_000 + "1"),
                                               ("neg.py", "x = " + "-" * 100_000 + "1"),
                                               ("attr.py", "x = a" + ".b" * 100_000),
                                               ("deep.json", "[" * 100_000 + "]" * 100_000),
                                               ("deep.toml", "x = " + "[" * 100_000 + "]" * 100_000)])
def test_syntax_gate_survives_pathological_sources(ctx, ws, name, content):
    put(ws, name, "[]" if name.endswith(".json") else "")  # parses, so an edit that breaks it is refused
    refused(write_file, ctx, name, content, seconds=30,
            match=f"edit rejected: it would leave {name!r} with a syntax error — the parser gave up: the code is "
                  "nested too deeply (or is too long a chain of operators). The file was not changed;")
    put(ws, name, content)  # already broken: editing it is allowed, with a warning
    out = answered(search_replace, ctx, name, content[:5], content[:5] + " ", replace_all=True, seconds=30)
    assert "does not parse" in out


def test_syntax_gate_skips_files_too_big_to_parse_cheaply(ctx, ws):
    start = time.monotonic()
    out = answered(write_file, ctx, "huge.py", "x = (" + "1," * 1_500_000 + ")\n")
    assert "not syntax-checked" in out and time.monotonic() - start < 5


# Special and oversized files ----------------------------------------------------------------------------------
def test_fifos_and_sockets_never_hang_a_tool(ctx, ws):
    sh(ws, "mkfifo fifo.txt fifo.py && python -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\"")
    for name in ("fifo.txt", "sock"):
        refused(read_file, ctx, name, match="not a regular file")
        refused(search_replace, ctx, name, "a", "b", match="not a regular file")
        refused(write_file, ctx, name, "x", match="not a regular file")
        refused(grep, ctx, "x", path=name, match="not a regular file")
        assert answered(read_lints, ctx, [name], seconds=70) == f"no Python files to lint in {name}."
    assert "fifo.txt" in answered(list_dir, ctx)
    assert "fifo.txt" in answered(glob, ctx, "fifo*")
    answered(grep, ctx, "to_roman", seconds=40)
    assert "lint" in answered(read_lints, ctx, seconds=70)
    assert answered(delete_file, ctx, "fifo.txt") == "deleted 'fifo.txt'."


def test_files_over_the_limit_are_refused_without_reading_them(ctx, ws):
    sh(ws, f"truncate -s {MAX_FILE_BYTES + 1} big.txt && truncate -s 200M huge.bin && "
           f"truncate -s {MAX_FILE_BYTES} limit.bin")
    message = refused(read_file, ctx, "big.txt", match=f"{MAX_FILE_BYTES + 1} bytes")
    assert "sed -n" in message and "grep" in message
    refused(search_replace, ctx, "big.txt", "a", "b", match="bytes")
    tracemalloc.start()
    try:
        refused(ws.read_bytes, "huge.bin", match="bytes")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20
    assert len(ws.read_bytes("limit.bin")) == MAX_FILE_BYTES
    assert answered(write_file, ctx, "big.txt", "small now\n").startswith("overwrote")


def test_symlink_loops(ctx, ws):
    sh(ws, "ln -s loop loop && ln -s b a && ln -s a b && mkdir up && ln -s .. up/root")
    for path in ("loop", "a/x.py", "loop/x"):
        loop = f"path {path!r} runs into a loop of symbolic links; use a path without them (`ls -l` in run_terminal"
        refused(read_file, ctx, path, match=loop)
        refused(write_file, ctx, path, "x", match=loop)
        refused(delete_file, ctx, path, match=loop)
        refused(list_dir, ctx, path, match=loop)
        refused(glob, ctx, "*", path=path, match=loop)
    out = answered(glob, ctx, "**/*.py")
    assert "up/root" not in out and "pocketlib/roman.py" in out
    assert "loop" in answered(list_dir, ctx)
    answered(grep, ctx, "to_roman", seconds=40)


def test_directory_where_a_file_is_expected(ctx, ws):
    refused(write_file, ctx, "pocketlib", "x", match="directory")
    refused(write_file, ctx, "README.md/x.py", "x", match="a part of 'README.md/x.py' is not a directory.")
    refused(read_file, ctx, "README.md/x.py", match="'README.md/x.py' does not exist.")
    refused(search_replace, ctx, "tests", "a", "b", match="directory")
    refused(ws.read_bytes, "pocketlib", match="'pocketlib' is a directory.")
    refused(ws.write_bytes, "pocketlib", b"x", match="'pocketlib' is a directory.")
    refused(ws.write_bytes, "README.md/x", b"x", match="a part of 'README.md/x' is not a directory.")
    refused(ws.delete, "pocketlib", match="'pocketlib' is a directory.")


def test_permission_denied_is_a_tool_error(ctx, ws):
    if isinstance(ws, LocalWorkspace) and os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    sh(ws, "echo secret > locked.txt && chmod 000 locked.txt && mkdir shut && echo x > shut/f.py && chmod 000 shut")
    try:
        refused(read_file, ctx, "locked.txt", match="permission")
        refused(search_replace, ctx, "locked.txt", "secret", "public", match="permission")
        refused(list_dir, ctx, "shut", match="permission")
        answered(glob, ctx, "**/*.py")
    finally:
        sh(ws, "chmod 755 shut")


def test_swapped_for_a_symlink_after_resolve(ws, outside):
    """A concurrent process replaces a checked path (or one of its directories) with a symlink that leaves."""
    sh(ws, f"mkdir sub && echo inside > sub/f.txt && echo inside > g.txt && echo SECRET > {outside}/f.txt")
    in_dir, top = ws.resolve("sub/f.txt"), ws.resolve("g.txt")
    sh(ws, f"rm -r sub && ln -s {outside} sub && rm g.txt && ln -s {outside}/f.txt g.txt")
    for rel in (in_dir, top):
        refused(ws.read_bytes, rel, match="symbolic link")
        refused(ws.write_bytes, rel, b"pwned", match="symbolic link")
    refused(ws.delete, in_dir, match="symbolic link")
    refused(ws.listdir, "sub", match="symbolic link")
    assert sh(ws, f"cat {outside}/f.txt") == "SECRET\n"
    sh(ws, "rm g.txt && mkfifo g.txt")  # ... or with a FIFO
    refused(ws.read_bytes, top, match="not a regular file")
    refused(ws.write_bytes, top, b"x", match="not a regular file")


# Lints -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [None, ("pyproject.toml", '[tool.ruff]\nextend = "{outside}/conf.toml"\n'),
                                    ("ruff.toml", 'extend = "{outside}/conf.toml"\n'),
                                    (".ruff.toml", 'extend = "sub/out/conf.toml"\ncache-dir = "{outside}/cache"\n')])
def test_read_lints_never_reads_outside_the_workspace(ctx, ws, outside, config):
    """Neither a configuration's `extend` (ruff's TOML error printed the first line of the file it named) nor a
    symlinked .py file (ruff linted it: its names came back in findings) lets read_lints read outside."""
    sh(ws, f"echo 'secret_token_xyz' > {outside}/secret.py && echo 'SECRETLINE_abc' > {outside}/conf.toml && "
           f"ln -s {outside}/secret.py leak.py && echo 'import os' > bad.py && mkdir sub && ln -s {outside} sub/out")
    if config is not None:
        put(ws, config[0], config[1].format(outside=outside))
    out = answered(read_lints, ctx, seconds=70)
    assert "bad.py:1:8: F401" in out, out
    assert "secret_token_xyz" not in out and "SECRETLINE" not in out, out
    assert sh(ws, f"ls {outside}") == "conf.toml\nsecret.py\n"


def test_read_lints_keeps_the_projects_own_rule_settings(ctx, ws):
    put(ws, "ruff.toml", 'line-length = 20\n[lint]\nselect = ["E501"]\n[lint.per-file-ignores]\n"skip.py" = ["E501"]\n')
    put(ws, "long.py", "x = 'a long line, longer than twenty'\n")
    put(ws, "skip.py", "x = 'a long line, longer than twenty'\n")
    out = answered(read_lints, ctx, seconds=70)
    assert "long.py:1:21: E501" in out and "skip.py" not in out, out


# The agent loop ----------------------------------------------------------------------------------------------
def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>\n'


def raw_call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>\n"


def test_hostile_episode_completes_with_tool_errors(ws, outside, tmp_path):
    """A scripted model sends the hostile calls through the real agent loop (parser, executor, tools, workspace,
    tokenizer, trajectory file and the CLI's display): the episode ends normally, each bad call a tool error."""
    sh(ws, f"mkfifo pipe.txt && truncate -s 200M huge.txt && printf x > $'odd\\xff.txt' && "
           f"echo 'SECRETLINE_abc' > {outside}/conf.toml && echo 'secret_token_xyz' > {outside}/secret.py && "
           f"ln -s {outside}/secret.py leak.py && ln -s loop loop")
    put(ws, "ruff.toml", f'extend = "{outside}/conf.toml"\n')
    script = [
        call("grep", pattern="a\x00b") + call("run_terminal", command="echo a\x00b") + call("glob", pattern="**a")
        + call("glob", pattern=""),
        call("read_file", path="pipe.txt") + call("read_file", path="huge.txt") + call("read_file", path="loop")
        + call("write_file", path="pipe.txt", content="x"),
        raw_call('{"name": "read_file", "arguments": {"path": "README.md", "offset": 2.0, "limit": 1e300}}')
        + raw_call('{"name": "read_file", "arguments": {"path": "README.md", "offset": ' + "9" * 5000 + "}}")
        + raw_call('{"name": "read_file", "arguments": {"path": ' + "[" * 5000 + "]" * 5000 + "}}")
        + raw_call('<function=read_file><parameter=path>x</parameter><parameter=limit>' + "9" * 5000
                   + "</parameter></function>"),
        call("read_file", path="a\ud800.py") + call("list_dir") + call("glob", pattern="*.txt")
        + call("read_lints"),
        call("glob", pattern="**/" * 12 + "*.py") + call("read_file", path="x" * 5000),
        "Done.",
    ]
    start = time.monotonic()
    config = LoopConfig(max_failed_turns=10, max_new_tokens=200_000, max_tokens=1_000_000)  # whole turns
    with open(os.devnull, "w", encoding="utf-8") as sink:  # a real encoding: a lone surrogate would raise
        console = Console(file=sink, width=120)
        agent = Agent(ReplayEngine(script), ws, config, on_turn=lambda t, p: console.print(render_turn(t, p)))
        traj = bounded(agent.run, "survive", out=str(tmp_path / "traj.json"), seconds=150)
    assert not isinstance(traj, BaseException), repr(traj)
    assert traj.stop_reason == "finished" and len(traj.turns) == len(script)
    calls = [c for t in traj.turns for c in t.calls]
    errors = {c.index + 10 * t.index for t in traj.turns for c in t.calls if c.error}
    assert errors >= {0, 1, 3, 10, 11, 12, 13, 21, 22, 23, 30, 41}, [c.error for c in calls]
    read, limited = traj.turns[2].calls[:2]
    assert read.error is None and "2\t" in read.output  # integral floats are integers
    assert limited.error_kind == "malformed" and limited.error.startswith(
        "tool call #2: a value in the JSON cannot be used (Exceeds the limit (4300 digits)")
    listing, txt, lints = traj.turns[3].calls[1:]
    assert listing.error is None and "odd" in listing.output and txt.error is None
    assert lints.error is None and "secret_token_xyz" not in lints.output and "SECRETLINE" not in lints.output
    for c in calls:
        c.output.encode()  # every response is valid text the tokenizer took
    assert Trajectory.load(tmp_path / "traj.json").token_ids() == traj.token_ids()
    assert time.monotonic() - start < 150


# Fuzzing -----------------------------------------------------------------------------------------------------
SPECIAL = ["\x00", "\ud800", "\udcff", "\n", "..", "/", "**", "*", "[", "-", "~", "$(", "`", "'", '"', "\\", " ",
           "\u202e", "é", "%s", "{}", "a" * 300, "../" * 5, "/etc/passwd", "README.md", "pocketlib", "tests/"]
TEXT = st.lists(st.one_of(st.text(max_size=6), st.sampled_from(SPECIAL)), max_size=5).map("".join)
INTS = st.one_of(st.integers(-3, 3), st.integers(-(2 ** 70), 2 ** 70), st.sampled_from([0, -1, 10 ** 300]),
                 st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: f.is_integer()))


def _value(schema: dict) -> st.SearchStrategy:
    kind = schema.get("type")
    if kind == "string":
        return st.sampled_from(schema["enum"]) if "enum" in schema else TEXT
    if kind == "integer":
        return INTS
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(_value(schema["items"]), max_size=4)
    if kind == "object":
        props = schema["properties"]
        return st.fixed_dictionaries({k: _value(v) for k, v in props.items()})
    return st.none()


FUZZED = [t for t in default_tools() if t.name != "run_terminal"]


@st.composite
def hostile_turn(draw) -> str:
    """One turn of 1-3 calls with schema-shaped but hostile arguments (and sometimes a wrong type)."""
    blocks = []
    for _ in range(draw(st.integers(1, 3))):
        tool = draw(st.sampled_from(FUZZED))
        props = tool.parameters["properties"]
        names = draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
        args = {k: draw(_value(props[k])) for k in set(names) | set(tool.parameters["required"])}
        if args and draw(st.integers(0, 9)) == 0:
            args[draw(st.sampled_from(sorted(args)))] = draw(st.one_of(INTS, st.none(), st.lists(TEXT, max_size=2)))
        blocks.append(call(tool.name, **args))
    if draw(st.booleans()):  # run_terminal only with harmless commands around hostile bytes
        cmd = "printf %s " + json.dumps(draw(TEXT)).replace("$", "").replace("`", "")
        blocks.append(call("run_terminal", command=cmd, timeout=draw(INTS)))
    return "".join(blocks)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(turn=hostile_turn())
def test_fuzzed_calls_through_parser_and_executor_never_raise(workspace, turn):
    tools = default_tools()
    ctx = ToolContext(workspace)
    executor = ToolExecutor(tools, ctx)
    try:
        parsed = ToolCallParser(tools).parse(turn)
        records = executor.execute(parsed.calls)
    finally:
        executor.close()
        ctx.close()
    assert len(records) == len(parsed.calls)
    for r in records:
        r.output.encode()
        assert len(r.output) < 100_000


def test_parser_reports_json_python_will_not_decode():
    parser = ToolCallParser(default_tools())
    bodies = ['{"name": "read_file", "arguments": {"path": "a", "offset": ' + "9" * 5000 + "}}",
              '{"name": "read_file", "arguments": {"path": ' + "[" * 5000 + "]" * 5000 + "}}",
              '{"name": "read_file", "arguments": "{\\"path\\": ' + "[" * 5000 + "]" * 5000 + '}"}',
              "<function=read_file><parameter=path>a</parameter><parameter=limit>" + "9" * 5000
              + "</parameter></function>"]
    turn = parser.parse("".join(raw_call(b) for b in bodies))
    assert [c.error is not None for c in turn.calls] == [True] * 4
    assert "4300 digits" in turn.calls[0].error and "nested too deeply" in turn.calls[1].error
    bare = parser.parse('{"name": ["read_file"], "arguments": {}} {"name": "read_file", "arguments": {"path": '
                        + "9" * 5000 + "}}")
    # The second object is an attempted read_file call (issue 15: answered, not taken for a final answer); the first,
    # whose name is not a string, is not a call. No exception either way.
    assert [c.error_kind for c in bare.calls] == ["untagged"] and "4300 digits" in bare.calls[0].error
    assert [c.error_kind for c in ToolCallParser(default_tools(), "accept").parse(bare.content).calls] == ["malformed"]
    assert parser.parse(raw_call('{"name": "read_file", "arguments": {"path": "a", "offset": 2.0}}')).calls[0] \
        .arguments["offset"].__class__ is int


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.one_of(st.text(), st.sampled_from(
    ["<tool_call>", "</tool_call>", "{", "}", "[" * 3000, "9" * 5000, '"name": "read_file"', '"arguments":',
     "<function=read_file>", "<parameter=limit>", "</parameter>", "</function>", "1e400", "-0", "\ud800"])),
    max_size=12).map("".join))
def test_parser_never_raises(text):
    for parser in (ToolCallParser(default_tools()), ToolCallParser(default_tools(), "accept")):
        turn = parser.parse(text)
        assert [c.index for c in turn.calls] == list(range(len(turn.calls)))
        for c in turn.calls:
            if c.error is None:
                assert c.name in parser.tools and type(c.arguments) is dict and c.error_kind is None
            else:
                assert c.error.startswith(f"tool call #{c.index + 1}") and c.error_kind in ERROR_KINDS, c
