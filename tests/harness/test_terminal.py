import time

import pytest

from shipyard.harness.tools import ToolContext, ToolError
from shipyard.harness.tools.terminal import run_terminal


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
