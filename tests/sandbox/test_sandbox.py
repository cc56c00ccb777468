"""The Sandbox workspace's lifecycle: restart of a dead exec session, clean close, limits from the host."""

import subprocess

import pytest
from test_security import _problem, host_is_clean

from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox, SessionRestarted
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot

pytestmark = pytest.mark.skipif(_problem is not None, reason=f"this host cannot start bubblewrap sandboxes: {_problem}")


@pytest.fixture
def snapshot(repo):
    snap = make_snapshot(repo, host())
    yield snap
    remove_snapshot(snap)


def test_dead_session_restarts_over_the_same_files(snapshot):
    with Sandbox(snapshot) as sb:
        sb.write_bytes("kept.txt", b"still here")
        with pytest.raises(SessionRestarted, match="restarted over the same files"):
            sb.run(["bash", "-c", "pkill -9 -f shipyard.sandbox.session; sleep 5"], timeout=30)
        assert sb.restarts == 1
        assert sb.read_bytes("kept.txt") == b"still here"
        assert sb.run(["true"], timeout=10).exit_code == 0
    assert host_is_clean()


def test_close_kills_background_jobs_and_cleans_up(snapshot):
    sb = Sandbox(snapshot)
    job = sb.spawn(["bash", "-c", "sleep 1000"], cwd="/workspace", env=sb.environment())
    assert job.running()
    layout = sb.layout.root
    sb.close()
    assert not layout.exists()
    assert host_is_clean()
    with pytest.raises(RuntimeError, match="closed"):
        sb.kind(".")


def test_files_written_in_the_sandbox_belong_to_the_sandbox_uid(snapshot):
    with Sandbox(snapshot) as sb:
        sb.write_bytes("owned.txt", b"x")
        owner = (sb.layout.upper / "owned.txt").stat().st_uid
        assert owner == host().uid
        assert subprocess.run(["test", "-e", str(snapshot / "owned.txt")]).returncode == 1


def test_session_killed_between_calls_restarts_on_next_call(snapshot):
    import time

    from shipyard.harness.process import kill_group

    with Sandbox(snapshot) as sb:
        sb.write_bytes("kept.txt", b"x")
        kill_group(sb._proc.pid)  # e.g. killed by a limit while idle
        sb._proc.wait()
        start = time.monotonic()
        assert sb.read_bytes("kept.txt") == b"x"
        assert sb.restarts == 1 and time.monotonic() - start < 10
