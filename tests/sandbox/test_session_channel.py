"""The exec session's channel to the host, attacked from inside the sandbox, and the host's memory per reply.

Sandboxed code runs as the same uid, in the same pid namespace, as the exec session (and as bwrap's init, pid 1),
so it can name their file descriptors (`/proc/PID/fd/N`, `pidfd_getfd`). Through the session's reply pipe it
could forge the reply to a pending call (a grader's `run`: the reward), kill the host's reader with one line of
garbage, or grow host memory with one endless line. These tests run the attack for real and check that nothing
is reachable and the host side stays answered, with its memory bounded.

Being non-dumpable does not stop signals, `prlimit`, `renice`, `chrt`, `taskset` or `ionice` on the session: the
last tests stop it, lower its limits and its scheduling, and check that no later call hangs or runs weakened.
"""

import base64
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest
from own_memory import traced
from servers import needs_sandbox
from test_security import nothing_left

from shipyard.harness.workspace import MAX_FILE_BYTES, PathError
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox, SessionRestarted, _Channel
from shipyard.sandbox.session import MAX_LINE_BYTES, channel_keys, encode_reply
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot

pytestmark = needs_sandbox

# Inside the sandbox: every pipe or socket another process holds, reached through /proc/PID/fd (open) and through
# pidfd_getfd, and the session's memory (/proc/PID/mem, ptrace); into each pipe that opens for writing, a forged
# reply for every plausible pending id, a 100 MB line and a line of garbage. Prints what it reached and what
# refused it.
ATTACK = r'''
import base64, ctypes, json, os, signal

libc = ctypes.CDLL(None, use_errno=True)
me = os.getpid()
own = set()
for n in os.listdir("/proc/self/fd"):
    try:
        own.add(os.readlink(f"/proc/self/fd/{n}"))
    except OSError:
        pass
reached, refused = [], []

def foreign(target):
    return target.startswith(("pipe:", "socket:")) and target not in own

for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
    if pid == me:
        continue
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError as e:
        refused.append(f"listdir /proc/{pid}/fd: {e.strerror}")
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError as e:
            refused.append(f"readlink /proc/{pid}/fd/{fd}: {e.strerror}")
            continue
        if not foreign(target):
            continue
        for mode in (os.O_WRONLY, os.O_RDONLY):
            try:
                reached.append((f"open /proc/{pid}/fd/{fd} {target} mode {mode}",
                                os.open(f"/proc/{pid}/fd/{fd}", mode | os.O_NONBLOCK), mode))
            except OSError as e:
                refused.append(f"open /proc/{pid}/fd/{fd} ({target}): {e.strerror}")
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    if b"shipyard.sandbox.session" in cmdline and b"bwrap" not in cmdline.split(b"\0")[0]:  # not bwrap's init
        for name in ("mem", "environ"):  # its memory holds the channel's key
            try:
                os.close(os.open(f"/proc/{pid}/{name}", os.O_RDONLY))
                reached.append((f"open /proc/{pid}/{name}", None, os.O_RDONLY))
            except OSError as e:
                refused.append(f"open /proc/{pid}/{name}: {e.strerror}")
        if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
            reached.append((f"ptrace {pid}", None, os.O_RDONLY))
        else:
            refused.append(f"ptrace {pid}: {os.strerror(ctypes.get_errno())}")
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        continue
    for n in range(64):
        got = libc.syscall(438, pidfd, n, 0)  # pidfd_getfd
        if got < 0:
            if ctypes.get_errno() != 9:  # EBADF: no such descriptor
                refused.append(f"pidfd_getfd {pid}/{n}: {os.strerror(ctypes.get_errno())}")
            continue
        target = os.readlink(f"/proc/self/fd/{got}")
        if foreign(target):
            reached.append((f"pidfd_getfd {pid}/{n} {target}", got, os.O_RDWR))
        else:
            os.close(got)

forged = {"output": base64.b64encode(b"FORGED").decode(), "exit_code": 0, "timed_out": False, "seconds": 0.0,
          "dropped_bytes": 0}

def alarm(*_):
    raise TimeoutError

signal.signal(signal.SIGALRM, alarm)
for desc, fd, mode in reached:
    if mode == os.O_RDONLY:
        continue
    os.set_blocking(fd, True)
    try:
        signal.alarm(10)
        for i in range(1, 64):
            os.write(fd, json.dumps({"id": i, "result": forged}).encode() + b"\n")
        chunk = b"x" * (1 << 20)
        for _ in range(100):
            os.write(fd, chunk)
        os.write(fd, b"\nnot json at all\n")
        signal.alarm(0)
    except (OSError, TimeoutError) as e:
        signal.alarm(0)
        refused.append(f"write {desc}: {type(e).__name__}")
print(json.dumps({"reached": [d for d, _, _ in reached], "refused": refused}))
'''


@pytest.fixture
def snapshot(tmp_path):
    src = tmp_path / "repo"
    src.mkdir()
    (src / "app.py").write_text("print('hello')\n")
    snap = make_snapshot(src, host())
    yield snap
    remove_snapshot(snap)


def test_sandboxed_code_cannot_reach_or_forge_the_session_channel(snapshot):
    with Sandbox(snapshot) as sb:
        sb.write_bytes("attack.py", ATTACK.encode())
        with traced() as host_memory:  # what the host allocates meanwhile (its reader: pure Python)
            r = sb.run(["python3", "attack.py"], timeout=60)
        assert b"FORGED" not in r.output, "a reply forged inside the sandbox was taken for the session's"
        report = json.loads(r.output)
        assert r.exit_code == 0
        assert report["reached"] == [], f"sandboxed code reached the channel: {report['reached']}"
        session_pid = next(line.split()[1].rstrip(":") for line in report["refused"] if line.startswith("ptrace "))
        assert any(line.startswith(f"pidfd_getfd {session_pid}/") for line in report["refused"])
        start = time.monotonic()
        assert sb.run(["echo", "still answered"], timeout=10).output == b"still answered\n"
        assert time.monotonic() - start < 5
        assert sb.restarts == 0
        assert host_memory.peak_mb < 64
    assert nothing_left()


def test_reading_a_huge_file_is_refused_with_bounded_host_memory(snapshot):
    with Sandbox(snapshot) as sb:
        assert sb.run(["truncate", "-s", "200M", "big.bin"], timeout=10).exit_code == 0
        start = time.monotonic()
        with traced() as host_memory, pytest.raises((OSError, PathError),
                                                    match=f"{200 << 20} bytes, more than the {MAX_FILE_BYTES}"):
            sb.read_bytes("big.bin")  # refused by the workspace, else by the session (its reply cap)
        assert time.monotonic() - start < 10
        assert host_memory.peak_mb < 64, "reading a 200 MB file cost the host its size several times over"
        assert sb.read_bytes("app.py") == b"print('hello')\n"  # the session is fine
    assert nothing_left()


def test_the_session_never_sends_a_reply_over_the_line_limit():
    """Whatever a method returns (a listing of a million long names, say), the reply on the wire fits a line."""
    reply = json.loads(encode_reply(7, "glob", {"result": ["x" * 200] * (MAX_LINE_BYTES // 200)}))
    assert reply["id"] == 7 and reply["error"]["errno"] == errno.EFBIG
    assert f"more than the {MAX_LINE_BYTES} that may cross from the sandbox to the host" in reply["error"]["message"]
    assert json.loads(encode_reply(8, "ping", {"result": "pong"})) == {"id": 8, "result": "pong"}


# A writer process on the reply pipe: garbage, a forged reply (bad seal) for the pending id, a line four times the
# limit, a sealed reply for an id nobody waits for, then the genuine sealed reply.
WRITER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[3])
from shipyard.sandbox.session import seal
key, pending = bytes.fromhex(sys.argv[1]), int(sys.argv[2])
out = os.fdopen(1, "wb")
out.write(b"not json at all\n" + b"\x00\xff" * 1000 + b"\n")
out.write(b"0" * 64 + b" " + json.dumps({"id": pending, "result": "forged"}).encode() + b"\n")
out.write(json.dumps({"id": pending, "result": "forged, unsealed"}).encode() + b"\n")
chunk = b"x" * (1 << 20)
for _ in range(int(sys.argv[4])):
    out.write(chunk)
out.write(b"\n")
out.write(seal(key, json.dumps({"id": pending + 1000, "result": "nobody asked"}).encode()))
out.write(seal(key, json.dumps({"id": pending, "result": "genuine"}).encode()))
out.flush()
"""


def test_host_reader_survives_garbage_forgeries_and_an_endless_line(snapshot):
    """Whatever reaches the reply pipe, the reader keeps going with bounded memory and takes only sealed replies."""
    with Sandbox(snapshot) as sb:
        _, reply_key = channel_keys(os.urandom(32))
        read_end, write_end = os.pipe()
        channel = _Channel(os.open(os.devnull, os.O_WRONLY), b"", reply_key)
        pending: Future = Future()
        channel.pending[7] = pending
        ignored = sb.ignored_lines
        reader = threading.Thread(target=sb._read, args=(read_end, channel), daemon=True)
        megabytes = 4 * MAX_LINE_BYTES >> 20
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["shipyard"].__file__)))
        with traced() as host_memory:  # the reader thread's allocations (pure Python), not the writer's
            reader.start()
            subprocess.run([sys.executable, "-c", WRITER, reply_key.hex(), "7", package_root, str(megabytes)],
                           stdout=write_end, check=True, timeout=60)
            os.close(write_end)
            assert pending.result(timeout=10) == {"id": 7, "result": "genuine"}
            reader.join(timeout=10)
        assert not reader.is_alive()  # it ended at end of file, not on an exception
        assert sb.ignored_lines - ignored == 6  # two of garbage, two forged, the endless one, the unasked
        assert host_memory.peak_mb < 64, "an endless line grew the host's reader"
        assert sb.run(["echo", "ok"], timeout=10).output == b"ok\n"
        channel.close()


def test_final_diff_of_a_huge_file_and_a_fifo_is_small_and_names_them(snapshot):
    episode = ("truncate -s 400M big.bin && mkfifo pipe && echo 'x = 1' >> app.py && echo data > same.txt && "
               "cp same.txt copy.txt && touch same.txt")
    with Sandbox(snapshot) as sb:
        assert sb.run(["bash", "-c", episode], timeout=30).exit_code == 0
        start = time.monotonic()
        with traced() as host_memory:
            patch = sb.diff()
        assert time.monotonic() - start < 10
        assert host_memory.peak_mb < 64
    assert len(patch) < 4096, patch[:4096]
    assert "diff --git a/app.py b/app.py" in patch and "+x = 1" in patch and "diff --git a/copy.txt" in patch
    note = [line for line in patch.splitlines() if line.startswith("#")]
    assert any('"big.bin": now a file of 419430400 bytes' in line for line in note), note
    assert any('"pipe": now a FIFO' in line for line in note), note
    assert patch.index("# shipyard") < patch.index("diff --git")  # before the first diff, where git apply ignores it


# Inside the sandbox: tamper with the exec session (found by its command line; bwrap's init has the same words in
# its own) in one of the ways its uid allows, on every thread. With a delay, return at once and do it later from a
# process left behind in its own session, then leave a marker file, as an episode could before a grader's run.
TAMPER = r"""
import os, resource, signal, subprocess, sys, time

action, delay = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
if delay:
    if os.fork():
        sys.exit(0)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    time.sleep(delay)
session = []
for pid in os.listdir("/proc"):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except (OSError, ValueError):
        continue
    if not argv[0].endswith(b"bwrap") and any(b"from shipyard.sandbox.session import main" in a for a in argv):
        session.append(int(pid))
[pid] = session
threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
if action == "stop":
    os.kill(pid, signal.SIGSTOP)
elif action == "limits":
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (4096, 4096))
    resource.prlimit(pid, resource.RLIMIT_CPU, (2, 2))
elif action == "nice":
    for t in threads:
        os.setpriority(os.PRIO_PROCESS, t, 19)  # the lowest priority: allowed from any, also in a niced test run
elif action == "sched_idle":
    for t in threads:
        os.sched_setscheduler(t, os.SCHED_IDLE, os.sched_param(0))
elif action == "affinity":
    for t in threads:
        os.sched_setaffinity(t, {min(os.sched_getaffinity(t))})
elif action == "ioprio":
    for t in threads:
        subprocess.run(["ionice", "-c", "3", "-p", str(t)], check=True)
open(f"/workspace/done-{action}-{delay}", "w").close()
"""

# What a command the session starts inherits from it: rlimits, nice, scheduling policy, CPUs, I/O priority; and
# whether it can write 100 KB.
STATE = r"""
import json, os, resource, shutil, subprocess
with open("/tmp/100k", "wb") as f:
    f.write(b"x" * 100_000)
print(json.dumps({"rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource)
                              if n.startswith("RLIMIT_")},
                  "nice": os.getpriority(os.PRIO_PROCESS, 0), "policy": os.sched_getscheduler(0),
                  "cpus": sorted(os.sched_getaffinity(0)),
                  "ioprio": shutil.which("ionice") and subprocess.run(["ionice"], capture_output=True).stdout.decode(),
                  "wrote": os.path.getsize("/tmp/100k")}))
"""


def _state(sb: Sandbox) -> dict:
    r = sb.run(["python3", "state.py"], timeout=10)
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _wait_for(path, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear within {seconds} s"
        time.sleep(0.05)


@pytest.mark.parametrize("action", ["stop", "limits", "nice", "sched_idle", "affinity", "ioprio"])
def test_tampering_with_the_session_never_hangs_or_weakens_later_calls(snapshot, action):
    """The tampering call fails promptly with SessionRestarted; tampering by a process left behind is undone before
    the next call runs. Either way every later command starts with the session's original limits and priorities."""
    if action == "affinity" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no affinity to narrow")
    if action == "ioprio" and shutil.which("ionice") is None:
        pytest.skip("no ionice on this host")
    if action == "nice" and os.getpriority(os.PRIO_PROCESS, 0) == 19:
        pytest.skip("the test run is at nice 19: no priority left to lower")
    with Sandbox(snapshot) as sb:
        sb.write_bytes("tamper.py", TAMPER.encode())
        sb.write_bytes("state.py", STATE.encode())
        clean = _state(sb)
        assert clean["wrote"] == 100_000
        start = time.monotonic()
        with pytest.raises(SessionRestarted, match="restarted"):
            sb.run(["python3", "tamper.py", action], timeout=5)
        # a loose guard (~0.3 s, 60x): waited on to the end of its wait (the timeout + 60 s) it would be 65 s
        assert time.monotonic() - start < 20, "the call that tampered with the session was waited on to its end"
        assert sb.restarts == 1
        assert sb._call("ping", wait=3) == "pong"
        assert _state(sb) == clean

        assert sb.run(["python3", "tamper.py", action, "0.2"], timeout=5).exit_code == 0
        _wait_for(sb.layout.upper / f"done-{action}-0.2")
        start = time.monotonic()
        assert sb._call("ping", wait=3) == "pong"
        assert _state(sb) == clean
        assert time.monotonic() - start < 20  # a loose guard: ~0.3 s
        assert sb.restarts == 2
        assert sb.read_bytes("app.py") == b"print('hello')\n"
    assert nothing_left()


def test_a_call_unanswered_within_its_wait_restarts_the_session(snapshot):
    """A session that does not answer in time is put down and restarted; it is not left to answer later calls."""
    with Sandbox(snapshot) as sb:
        sb.write_bytes("kept.txt", b"kept")
        start = time.monotonic()
        with pytest.raises(SessionRestarted, match="did not answer run within 1 s"):
            sb._call("run", wait=1, argv=["sleep", "30"], timeout=30, cwd=None, env=None, stdin=None)
        assert time.monotonic() - start < 20  # a loose guard: the 1 s wait and a restart, ~1.3 s; the sleep is 30 s
        assert sb.restarts == 1
        assert sb.read_bytes("kept.txt") == b"kept"
    assert nothing_left()


def test_a_request_too_big_for_the_pipe_gives_up_on_a_stopped_session(snapshot):
    """A stopped session stops reading: a request larger than the pipe's buffer must not block its caller (and every
    caller queued behind it on the pipe) for good."""
    with Sandbox(snapshot) as sb:
        sb.write_bytes("tamper.py", TAMPER.encode())
        assert sb.run(["python3", "tamper.py", "stop", "0.2"], timeout=5).exit_code == 0
        _wait_for(sb.layout.upper / "done-stop-0.2")
        outcome: Future = Future()

        def send() -> None:  # straight to the channel, past the check that precedes every call
            try:
                data = base64.b64encode(os.urandom(8 << 20)).decode()
                outcome.set_result(sb._send(sb._channel, "write_bytes", 60, {"path": "big.bin", "data": data}))
            except BaseException as e:
                outcome.set_exception(e)

        threading.Thread(target=send, daemon=True).start()
        with pytest.raises(SessionRestarted, match="stopped"):
            outcome.result(timeout=10)
        assert sb._call("ping", wait=3) == "pong"
        assert sb.restarts == 1
    assert nothing_left()


def test_a_session_started_from_a_short_lived_thread_outlives_it(snapshot):
    """bwrap runs with --die-with-parent, and the kernel's parent-death signal follows the *thread* that started
    it: a session (re)started from a tool call's worker thread must not die when that thread ends."""
    box: list[Sandbox] = []
    starter = threading.Thread(target=lambda: box.append(Sandbox(snapshot)))
    starter.start()
    starter.join()
    with box[0] as sb:
        time.sleep(0.5)
        assert sb._proc.poll() is None, "the session died with the thread that started the sandbox"
        restarter = threading.Thread(target=sb._restart, args=(sb._channel,))  # as after a failed call
        restarter.start()
        restarter.join()
        time.sleep(0.5)
        assert sb._proc.poll() is None, "the session died with the thread that started it"
        assert sb._call("ping", wait=3) == "pong"
        assert sb.restarts == 1
    assert nothing_left()
