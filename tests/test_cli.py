"""The `shipyard` command as a user runs it (a real subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import free_port
from typer.testing import CliRunner

from shipyard.cli import app

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}


def shipyard(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "shipyard.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=ENV, timeout=120)


def write_replay(path: Path, messages: list[str]) -> Path:
    path.write_text("".join(json.dumps(m) + "\n" for m in messages))
    return path


def test_agent_with_replay_prints_turns_diff_and_summary(repo, tmp_path):
    call = json.dumps({"name": "search_replace", "arguments": {
        "path": "pocketlib/stats.py", "old_string": "def mean(", "new_string": "def average("}})
    replay = write_replay(tmp_path / "s.jsonl", [f"<tool_call>{call}</tool_call>", "Renamed."])
    out = tmp_path / "traj.json"
    r = shipyard("agent", "rename mean", "--repo", str(repo), "--model", f"replay:{replay}", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "turn 1" in r.stderr and "search_replace" in r.stderr
    assert "+def average(" in r.stderr and "finished: 2 turns, 1 tool calls (0 failed)" in r.stderr
    assert json.loads(out.read_text())["stop_reason"] == "finished"
    assert "def average(" in (repo / "pocketlib/stats.py").read_text()


@pytest.mark.parametrize("args, message", [
    (["agent", "x", "--repo", "/no/such/dir", "--model", "random:tiny"], "is not a directory"),
    (["agent", "x", "--model", "replay:/no/such.jsonl"], "does not exist"),
    (["agent", "x", "--model", "/no/such/model.gguf"], "does not exist"),
    (["agent", "x", "--model", "openai:http://127.0.0.1:9/v1"], "cannot reach"),
    (["agent", "x", "--model", "random:tiny", "--untagged", "maybe"],
     "untagged_calls must be one of ('reject', 'accept'), not 'maybe'"),
    (["agent", "x", "--model", "random:tiny", "--tags", "auto"],
     "tags must be one of ('token', 'spelled'), not 'auto'"),
    (["dashboard", "--runs", "/no/such/dir"], "--runs /no/such/dir is not a directory"),
    (["synth", "--repo", ".", "--out", "synth-out", "--with", "not a requirement!"],
     "--with / requirements: 'not a requirement!' is not a"),
    (["bench", "nope"], "no benchmark 'nope'; available: engine, hacks, harness"),
])
def test_bad_input_gives_one_clear_line(args, message, repo, monkeypatch):
    monkeypatch.chdir(repo)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_replay_exhausted_is_reported(repo, tmp_path):
    replay = write_replay(tmp_path / "s.jsonl", ['<tool_call>{"name": "list_dir", "arguments": {}}</tool_call>'])
    r = CliRunner().invoke(app, ["agent", "x", "--repo", str(repo), "--model", f"replay:{replay}"])
    assert r.exit_code == 2 and "all 1 recorded messages were replayed" in r.output


def test_help_lists_commands():
    r = shipyard("--help")
    for command in ("agent", "demo", "serve", "bench"):
        assert command in r.stdout


def test_agent_with_scripted_model_fixes_the_planted_bug(tmp_path):
    from shipyard.rollout.demo import DEMO_REPLAY, DEMO_TASK, copy_example, plant_bug, run_tests

    work = copy_example(tmp_path / "pocketlib")
    plant_bug(work)
    assert not run_tests(work)[0]
    r = shipyard("agent", DEMO_TASK, "--repo", str(work), "--model", f"replay:{DEMO_REPLAY}")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stderr.split())
    assert "2 in parallel" in text
    assert "-        while number > value:" in r.stderr and "+        while number >= value:" in r.stderr
    assert run_tests(work)[0]


def test_serve_and_agent_over_http(repo, tmp_path):
    import time

    import httpx

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "shipyard.cli", "serve", "--model", "random:tiny", "--port",
                               str(port)], env={**ENV, "SHIPYARD_SERVE_TOKEN": "t" * 32},  # no token file in ~/.cache
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        out = tmp_path / "t.json"
        r = shipyard("agent", "hello", "--repo", str(repo), "--model", f"openai:http://127.0.0.1:{port}/v1",
                     "--max-turns", "1", "--max-new-tokens", "16", "--seed", "0", "--out", str(out))
        assert r.returncode == 0, r.stderr
        traj = json.loads(out.read_text())
        assert traj["model"].startswith(f"openai:http://127.0.0.1:{port}/v1")
        assert len(traj["turns"][0]["completion_ids"]) == len(traj["turns"][0]["logprobs"]) > 0
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_agent_in_sandbox_leaves_repo_untouched_and_writes_patch(repo, tmp_path):
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    edit = json.dumps({"name": "search_replace", "arguments": {
        "path": "pocketlib/stats.py", "old_string": "def mean(", "new_string": "def average("}})
    shell = json.dumps({"name": "run_terminal", "arguments": {"command": "touch created.txt; whoami; rm README.md"}})
    replay = write_replay(tmp_path / "s.jsonl", [f"<tool_call>{edit}</tool_call><tool_call>{shell}</tool_call>",
                                                 "Done."])
    out = tmp_path / "artifacts"
    r = shipyard("agent", "rename", "--repo", str(repo), "--model", f"replay:{replay}", "--sandbox",
                 "--artifacts", str(out))
    assert r.returncode == 0, r.stderr
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()} == before
    patch = (out / "patch.diff").read_text()
    assert "+def average(" in patch and "created.txt" in patch and "--- a/README.md" in patch
    assert json.loads((out / "summary.json").read_text())["stop_reason"] == "finished"
    traj = json.loads((out / "trajectory.json").read_text())
    assert "agent" in traj["turns"][0]["calls"][1]["output"]
    check = subprocess.run(["git", "apply", "--check", str(out / "patch.diff")], cwd=repo, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_agent_in_sandbox_can_grep_and_lint(repo, tmp_path):
    """From the venv shipyard is installed in, the sandboxed agent's grep (ripgrep) and read_lints (ruff) work."""
    calls = [{"name": "grep", "arguments": {"pattern": "def to_roman"}},
             {"name": "write_file", "arguments": {"path": "bad.py", "content": "import os\n"}},
             {"name": "read_lints", "arguments": {"paths": ["bad.py"]}}]
    replay = write_replay(tmp_path / "s.jsonl", ["".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls[:2]),
                                                 f"<tool_call>{json.dumps(calls[2])}</tool_call>", "Done."])
    out = tmp_path / "artifacts"
    r = shipyard("agent", "look around", "--repo", str(repo), "--model", f"replay:{replay}", "--sandbox",
                 "--artifacts", str(out))
    assert r.returncode == 0, r.stderr
    turns = json.loads((out / "trajectory.json").read_text())["turns"]
    grep_call, lint_call = turns[0]["calls"][0], turns[1]["calls"][0]
    assert grep_call["error"] is None and "pocketlib/roman.py:" in grep_call["output"], grep_call
    assert lint_call["error"] is None and "bad.py:1:8: F401" in lint_call["output"], lint_call


def test_dashboard_refuses_a_short_token(tmp_path, monkeypatch):
    monkeypatch.setenv("SHIPYARD_DASHBOARD_TOKEN", "short")
    r = CliRunner().invoke(app, ["dashboard", "--runs", str(tmp_path)])
    assert r.exit_code == 2 and "at least 16 characters" in r.output and "Traceback" not in r.output


def test_a_bug_is_not_reported_as_a_mistake(tmp_path, monkeypatch):
    """Only the user-error types become one "error:" line with status 2; a ValueError from inside a command is a bug:
    it passes through (the process prints its traceback) and the status is 1."""
    from shipyard.rollout import eval as evaluation
    from shipyard.rollout.eval import results

    doc = results({}, [1], config={"model": "m"}, wall_seconds=1.0)
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(doc))

    def planted(a, b):
        raise ValueError("a planted bug in compare")

    monkeypatch.setattr(evaluation, "compare", planted)
    r = CliRunner().invoke(app, ["eval", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert r.exit_code == 1 and isinstance(r.exception, ValueError) and str(r.exception) == "a planted bug in compare"
    assert "error:" not in r.output


def test_paths_and_test_ids_with_brackets_are_printed_as_text_not_markup(tmp_path):
    """A task repository's parametrized test ids (`test_open[/etc/passwd]`) and a user's paths reach the status lines:
    as markup, `[/etc/passwd]` is a closing tag that matches nothing and rich raised MarkupError mid-synthesis; `[a]`
    was eaten as a style."""
    from rich.console import Console

    from shipyard.bench import _common
    from shipyard.console import status_line

    hostile = "dropped tests/test_io.py::test_open[/etc/passwd] and test_x[bold] in [/tmp/run]"
    to = Console(record=True, width=300)
    status_line(hostile, to)
    assert hostile in to.export_text()
    saved, _common.console = _common.console, Console(record=True, width=300)
    try:
        _common.status(hostile)
        assert hostile in _common.console.export_text()
    finally:
        _common.console = saved
    runs = tmp_path / "[/x]"
    r = CliRunner().invoke(app, ["dashboard", "--runs", str(runs)])
    assert r.exit_code == 2 and f"{runs} is not a directory" in " ".join(r.output.split()), r.output
    config = Path(__file__).parent.parent / "configs" / "cpu.toml"
    r = CliRunner().invoke(app, ["train", "--check", str(config), "--run.dir", str(tmp_path / "run[/x]")])
    assert r.exit_code == 0 and "run[/x]" in r.output, r.output
