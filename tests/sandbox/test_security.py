"""Real attacks from inside real sandboxes. Each must be contained, and the host left clean afterwards."""

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from servers import needs_sandbox

from shipyard.sandbox.bwrap import Limits
from shipyard.sandbox.host import host
from shipyard.sandbox.layout import leftovers
from shipyard.sandbox.run import run_in_sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot

SECRET = "shipyard-secret-" + uuid.uuid4().hex


pytestmark = needs_sandbox


@pytest.fixture(scope="module")
def secret_file():
    path = Path.home() / f".shipyard-test-secret-{uuid.uuid4().hex[:8]}"
    path.write_text(SECRET)
    os.chmod(path, 0o600)
    yield path
    path.unlink()


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, secret_file):
    src = tmp_path_factory.mktemp("repo")
    (src / "app.py").write_text("print('hello')\n")
    (src / "escape").symlink_to(secret_file)
    (src / "etc-link").symlink_to("/etc")
    snap = make_snapshot(src, host())
    yield snap
    remove_snapshot(snap)


def sh(snapshot, script, timeout=30, **limits):
    return run_in_sandbox(snapshot, ["bash", "-c", script], timeout=timeout, limits=Limits(**limits))


def nothing_left(owner: int | None = None) -> bool:
    """Every sandbox this test process (or `owner`) started is gone (cgroups, dirs, mounts, processes). Only its
    own are checked: other sandboxes on the host (a second test run, a server) are none of its business."""
    for _ in range(100):  # processes outside a cgroup die asynchronously after their namespace's init
        if not leftovers(owner):
            return True
        time.sleep(0.02)
    raise AssertionError(f"left behind: {leftovers(owner)}")


@pytest.fixture(autouse=True)
def clean_host_after():
    yield
    assert nothing_left()


def test_host_loopback_server_unreachable(snapshot):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # the socket is closed when the test ends
            accepted.append(server.accept())

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    r = sh(snapshot, f"python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)\"")
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join(timeout=5)
    assert r.exit_code != 0 and b"Connection refused" in r.output
    assert not accepted


def test_no_network_at_all(snapshot):
    r = sh(snapshot, "python -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\"")
    assert r.exit_code != 0 and b"unreachable" in r.output.lower()


@pytest.mark.parametrize("target", ["/etc/shipyard-pwned", "/root/pwned", "/snapshot/pwned", "/usr/pwned",
                                    "/pwned", str(Path.home() / "pwned")])
def test_cannot_write_outside_the_workspace(snapshot, target):
    r = sh(snapshot, f"echo x > {target} && echo WROTE")
    assert b"WROTE" not in r.output
    assert not os.path.lexists(target) and not (snapshot / "pwned").exists()


def test_workspace_writes_never_reach_the_snapshot(snapshot):
    r = sh(snapshot, "echo changed > app.py && rm -f escape && echo new > new.py && cat app.py")
    assert r.exit_code == 0 and b"changed" in r.output
    assert (snapshot / "app.py").read_text() == "print('hello')\n" and (snapshot / "escape").is_symlink()
    assert not (snapshot / "new.py").exists()


def test_secrets_outside_are_invisible(snapshot, secret_file):
    r = sh(snapshot, f"cat {secret_file}; cat escape; cat /etc/shadow; ls etc-link/; "
                     f"grep -rs {SECRET} /workspace /snapshot /tmp /home /etc /run; ls -A /root")
    assert SECRET.encode() not in r.output
    listing = r.output.split(b"shadow: No such file")[-1]
    assert b"shadow" not in listing and b"passwd" in listing  # etc-link shows the sandbox's own /etc


def test_fork_bomb_is_contained(snapshot):
    r = sh(snapshot, "bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout=5, pids=64)
    assert b"fork: retry: Resource temporarily unavailable" in r.output  # the pids cap refused the bomb's forks
    # the script ended (its bash exits 0 even when `sleep` could not fork), or the timeout killed the sandbox
    assert (r.exit_code, r.timed_out) in ((0, False), (-signal.SIGKILL, True)), (r.exit_code, r.timed_out)
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_memory_bomb_is_killed(snapshot):
    r = sh(snapshot, "python -c \"x = bytearray(2 * 1024**3); print('ALLOCATED')\"", memory_mb=256)
    assert b"ALLOCATED" not in r.output and r.exit_code != 0


def test_one_huge_file_is_capped(snapshot):
    r = sh(snapshot, "dd if=/dev/zero of=big bs=1M count=500 2>&1; ls -l big", file_size_mb=50)
    assert b"File size limit exceeded" in r.output
    assert b" 52428800 " in r.output


@pytest.mark.skipif(not host().disk_quota, reason="the upper-dir quota needs root (a size-capped tmpfs mount)")
def test_many_files_cannot_fill_the_disk(snapshot):
    script = "for i in $(seq 1 40); do dd if=/dev/zero of=f$i bs=1M count=2 2>/dev/null || break; done; du -sm ."
    r = sh(snapshot, script + "; df -m /workspace | tail -1", disk_mb=20, file_size_mb=50)
    used = int(r.output.split()[0])
    assert 15 <= used <= 21, r.output
    assert b" 20 " in r.output  # df inside shows the quota as the workspace's size


def test_stdout_flood_is_bounded(snapshot):
    r = run_in_sandbox(snapshot, ["yes", "flood"], timeout=2, max_output=4096)
    assert r.timed_out and len(r.output) <= 8192 and r.dropped_bytes > 1_000_000


def test_orphans_and_sleepers_are_killed(snapshot):
    r = sh(snapshot, "nohup sleep 1000 >/dev/null 2>&1 & setsid sleep 1000 & disown; echo started")
    assert b"started" in r.output
    r = sh(snapshot, "sleep 1000", timeout=1)
    assert r.timed_out


def test_no_mount_unshare_or_host_processes(snapshot):
    r = sh(snapshot, "unshare -r true && echo UNSHARED; mount -t tmpfs none /tmp && echo MOUNTED; "
                     "ls /proc | grep -c '^[0-9]'")
    assert b"UNSHARED" not in r.output and b"MOUNTED" not in r.output
    assert int(r.output.split()[-1]) < 10  # only the sandbox's own processes are visible


def test_ptrace_of_sandbox_init_only_hurts_the_sandbox(snapshot):
    script = "python -c \"import ctypes; print('ATTACHED', ctypes.CDLL(None).ptrace(16, 1, 0, 0))\""
    r = sh(snapshot, script, timeout=5)
    if b"ATTACHED 0" in r.output:  # attached: the stopped init holds the sandbox open until the timeout kills it
        assert r.timed_out and r.exit_code == -signal.SIGKILL, (r.exit_code, r.timed_out)
    else:  # refused (a Yama ptrace_scope above 0): the script just ends
        assert b"ATTACHED -1" in r.output and (r.exit_code, r.timed_out) == (0, False), r.output
    # either way the host is checked clean after (clean_host_after)
