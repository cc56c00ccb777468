import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servers import needs_sandbox

from shipyard.harness.tools import ToolContext, ToolError
from shipyard.harness.tools.base import installed_binary
from shipyard.harness.tools.terminal import ShellSession, run_terminal
from shipyard.harness.workspace import LocalWorkspace


@pytest.fixture
def ctx(ws):
    c = ToolContext(ws, max_output_bytes=2000)
    yield c
    c.close()


def test_cwd_and_env_persist(ctx):
    run_terminal(ctx, "cd pocketlib && export GREETING=hi && LOCAL=1")
    out = run_terminal(ctx, 'pwd; echo "$GREETING-${LOCAL:-unset}"')
    assert out.splitlines()[0].endswith("/pocketlib")
    assert "hi-unset" in out  # exported variables persist, shell-local ones do not
    assert "[exit code 0]" in out


def test_exit_code_and_stderr(ctx):
    out = run_terminal(ctx, "echo oops >&2; exit 3")
    assert "oops" in out and "[exit code 3]" in out


def test_exit_keeps_state(ctx):
    run_terminal(ctx, "cd tests; exit 1")
    assert run_terminal(ctx, "pwd").splitlines()[0].endswith("/tests")


def test_timeout_kills_process_group(ctx):
    start = time.monotonic()
    out = run_terminal(ctx, "echo started; sleep 30 & sleep 30", timeout=1)
    assert time.monotonic() - start < 20  # a loose guard (the 1 s timeout, 20x); waiting for a sleep would be 30 s
    assert "started" in out and "timed out after 1 s" in out
    assert "[exit code 0]" in run_terminal(ctx, "true")  # the session survives


def test_output_truncated_head_and_tail(ctx):
    out = run_terminal(ctx, "seq 1 5000")
    assert out.startswith("1\n2\n") and "bytes dropped" in out and "5000" in out


def test_background_job(ctx):
    out = run_terminal(ctx, "python3 -c 'print(\"serving\", flush=True); import time; time.sleep(60)'",
                       background=True)
    assert "started background job" in out
    log = out.split("goes to ")[1].split(";")[0]
    for _ in range(50):
        if "serving" in run_terminal(ctx, f"cat {log}"):
            break
        time.sleep(0.1)
    assert "serving" in run_terminal(ctx, f"cat {log}")
    job = ctx.session.jobs[0]
    ctx.close()
    assert not job.running()  # killed with the session


def test_parallel_calls_do_not_persist(ctx):
    ctx.concurrent_terminals = 2
    out = run_terminal(ctx, "cd tests")
    assert "not kept" in out
    ctx.concurrent_terminals = 1
    assert not run_terminal(ctx, "pwd").splitlines()[0].endswith("/tests")


def test_argument_errors(ctx):
    with pytest.raises(ToolError):
        run_terminal(ctx, "  ")
    with pytest.raises(ToolError):
        run_terminal(ctx, "true", timeout=0)


def test_endless_output_is_bounded(ctx):
    out = run_terminal(ctx, "yes shipyard", timeout=2)
    assert "timed out" in out and "bytes dropped" in out
    assert len(out) < 3000
    dropped = int(out.split("[... ")[1].split(" bytes dropped")[0])
    assert dropped > 10_000_000  # ran for real, kept only head and tail


def test_escaped_background_process_does_not_hang_the_call(ctx):
    start = time.monotonic()
    out = run_terminal(ctx, "setsid sleep 30 & echo detached", timeout=10)
    assert "detached" in out and "[exit code 0]" in out and "timed out" not in out  # it ended, the sleep left running
    assert time.monotonic() - start < 20  # a loose guard: ~1 s (the pipe's grace); waiting for the sleep would be 30 s


def test_state_survives_redirected_output_and_fake_markers(ctx):
    run_terminal(ctx, "cd tests; export A=1; exec > /dev/null 2>&1; echo hidden")
    out = run_terminal(ctx, 'echo "@@shipyard-state-0000@@"; pwd; echo "A=$A"')
    assert "@@shipyard-state-0000@@" in out and out.splitlines()[1].endswith("/tests") and "A=1" in out


def test_deleted_working_directory_falls_back_to_root(ctx):
    run_terminal(ctx, "mkdir gone && cd gone")
    run_terminal(ctx, "rmdir ../gone")
    out = run_terminal(ctx, "pwd")
    assert "[exit code 0]" in out


# The project's environment first -------------------------------------------------------------------------------

def test_a_workspace_without_a_venv_keeps_its_environment(ws):
    """No `.venv` at the root (the example repository has none): PATH and VIRTUAL_ENV are the workspace's own."""
    base = ws.environment()
    session = ShellSession(ws)
    assert session.env["PATH"] == base["PATH"] and session.env.get("VIRTUAL_ENV") == base.get("VIRTUAL_ENV")


def test_a_local_venv_is_active_in_the_shell(repo):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(repo / ".venv")], check=True)
    ws = LocalWorkspace(repo)
    ctx = ToolContext(ws, max_output_bytes=4000)
    try:
        out = run_terminal(ctx, 'echo "$VIRTUAL_ENV"; command -v python; python -c "import sys; print(sys.prefix)"')
        venv = f"{ws.exec_root}/.venv"
        assert out.splitlines()[:3] == [venv, f"{venv}/bin/python", venv]
        assert ctx.session.env["PATH"].split(":")[1:] == [d for d in ws.environment()["PATH"].split(":")
                                                          if d and d != f"{venv}/bin"]  # the rest, in order
    finally:
        ctx.close()
        ws.close()


def test_a_venv_that_is_only_a_name_is_not_activated(repo):
    """A `.venv` that is a file, or a directory without `pyvenv.cfg`, is no environment: nothing changes."""
    (repo / ".venv").write_text("not a venv")
    ws = LocalWorkspace(repo)
    try:
        assert ShellSession(ws).env["PATH"] == ws.environment()["PATH"]
    finally:
        ws.close()


@needs_sandbox
def test_the_task_environment_comes_first_in_a_task_sandbox(taskset):
    """In a task's sandbox, `pytest` is the task venv's: the project's tests are collected and run (before, `pytest`
    was shipyard's, without the project: every test module failed with an ImportError), `python` imports the project,
    `pip` is the venv's, and shipyard's `rg` still resolves."""
    from shipyard.rollout.environment import LocalEnvironment
    from shipyard.rollout.record import EpisodeSpec
    from shipyard.tasks.taskset import list_tasks

    tasks_dir, _, _ = taskset
    task_id = list_tasks(tasks_dir)[0]
    with LocalEnvironment() as env, env.workspace(EpisodeSpec(task_id, Path(tasks_dir), "venv", 0, 0)) as ws:
        ctx = ToolContext(ws, max_output_bytes=20_000)
        try:
            out = run_terminal(ctx, "pytest -q -p no:cacheprovider")
            assert "ImportError" not in out and not re.search(r"\d+ errors?\b", out), out  # no collection error
            assert re.search(r"\d+ passed", out) and re.search(r"\d+ failed", out), out  # the task's tests fail
            out = run_terminal(ctx, 'python -c "import pocketlib; print(pocketlib.__file__)"; echo "$VIRTUAL_ENV"; '
                                    "command -v python pytest pip rg; pip --version")
            lines = out.splitlines()
            assert lines[:5] == ["/workspace/pocketlib/__init__.py", "/workspace/.venv", "/workspace/.venv/bin/python",
                                 "/workspace/.venv/bin/pytest", "/workspace/.venv/bin/pip"], out
            assert lines[5] == installed_binary("rg") and not lines[5].startswith("/workspace"), out
            assert "/workspace/.venv/lib/" in lines[6] and "[exit code 0]" in out, out
        finally:
            ctx.close()
