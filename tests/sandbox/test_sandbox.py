"""The Sandbox workspace's lifecycle: restart of a dead exec session, clean close, limits from the host."""

import os
import subprocess
import sys

import pytest
from servers import needs_sandbox
from test_security import nothing_left

from shipyard.sandbox.bwrap import Limits
from shipyard.sandbox.host import host
from shipyard.sandbox.layout import recover_stale
from shipyard.sandbox.sandbox import Sandbox, SandboxFailed, SessionRestarted
from shipyard.sandbox.snapshot import make_snapshot, recover_snapshots, remove_snapshot

pytestmark = needs_sandbox


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
    assert nothing_left()


def test_close_kills_background_jobs_and_cleans_up(snapshot):
    sb = Sandbox(snapshot)
    job = sb.spawn(["bash", "-c", "sleep 1000"], cwd="/workspace", env=sb.environment())
    assert job.running()
    layout = sb.layout.root
    sb.close()
    assert not layout.exists()
    assert nothing_left()
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


EPISODE = """
set -e
echo changed >> README.md
echo new > new.txt
rm pyproject.toml
rm -r tests && mkdir tests && echo 'only file' > tests/only.txt
mkdir -p deep/er && echo x > deep/er/leaf.txt
ln -s README.md link.md
"""


def test_an_episode_becomes_a_snapshot(snapshot):
    with Sandbox(snapshot) as sb:
        assert sb.run(["bash", "-c", EPISODE], timeout=30).exit_code == 0
        listing = sb.run(["bash", "-c", "find . | sort; cat README.md"], timeout=30).output
        saved = sb.save_snapshot()
    try:
        assert not (saved / "pyproject.toml").exists()
        assert sorted(p.name for p in (saved / "tests").iterdir()) == ["only.txt"]  # the opaque dir replaced it
        assert (saved / "link.md").is_symlink()
        assert (saved / "pocketlib" / "roman.py").read_bytes() == (snapshot / "pocketlib" / "roman.py").read_bytes()
        assert all(not a.startswith(("user.overlay", "trusted.overlay")) for p in saved.rglob("*")
                   if not p.is_symlink() for a in os.listxattr(p))
        with Sandbox(saved) as again:  # a sandbox over the new snapshot sees exactly what the episode left
            assert again.run(["bash", "-c", "find . | sort; cat README.md"], timeout=30).output == listing
            assert again.diff() == ""
            again.write_bytes("new.txt", b"editable\n")
    finally:
        remove_snapshot(saved)
    assert nothing_left()


def test_sandboxes_of_a_crashed_process_are_recovered(snapshot):
    crash = (f"from shipyard.sandbox.sandbox import Sandbox; import os; sb = Sandbox({str(snapshot)!r}); "
             "sb.run(['bash', '-c', 'sleep 1000 & echo started'], timeout=10); "
             "print(sb.id, os.getpid(), flush=True); os._exit(1)")
    out = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=60)
    sandbox_id, pid = out.stdout.split()[-2:]
    assert (host().state_dir / "sandboxes" / sandbox_id).exists()  # the crash left it behind
    assert sandbox_id in recover_stale(host())
    assert nothing_left(int(pid))


@pytest.mark.parametrize("limits", [{"pids": -1}, {"memory_mb": 0}, {"cpu_seconds": -1}, {"disk_mb": 0},
                                    {"open_files": 1.5}])
def test_limits_that_would_mean_unlimited_are_refused(limits):
    with pytest.raises(ValueError, match="whole numbers >= 1"):
        Limits(**limits)


def test_a_start_that_fails_leaves_nothing(snapshot):
    """A limit the kernel refuses (here: more memory than a cgroup accepts) fails the start and leaves nothing."""
    # by host: the cgroup write refuses it (OSError), setrlimit fails in the child (SubprocessError), or a v1 cgroup
    # takes the value and the session dies before answering (SandboxFailed)
    with pytest.raises((OSError, SandboxFailed, subprocess.SubprocessError)):
        Sandbox(snapshot, Limits(memory_mb=1 << 50, open_files=1 << 40))
    assert nothing_left()


def test_snapshots_of_a_crashed_process_are_recovered(repo):
    """Every snapshot in the state dir lives as long as the process that made it: a killed server's are removed by
    the next snapshot any shipyard process makes (its name is free again)."""
    name = f"crashed-{os.getpid()}"
    crash = (f"from shipyard.sandbox.host import host; from shipyard.sandbox.snapshot import make_snapshot; import os; "
             f"make_snapshot({str(repo)!r}, host(), {name!r}); os._exit(1)")
    subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=60)
    snaps = host().state_dir / "snapshots"
    assert (snaps / name).is_dir()  # the crash left it behind
    assert name in recover_snapshots(snaps)
    assert not (snaps / name).exists() and not (snaps / f".{name}.owner").exists()
    remove_snapshot(make_snapshot(repo, host(), name))  # the name is free again
