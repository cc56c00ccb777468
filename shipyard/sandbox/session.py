"""The exec session: a small server inside each sandbox, speaking sealed JSON lines over two private pipes.

It serves the `Workspace` operations of a `LocalWorkspace` rooted at `/workspace` (baseline `/snapshot`), so
the tools run inside the sandbox exactly the code they run on a local directory — one implementation, two
transports. Requests are handled concurrently (parallel tool calls of one turn); each response carries its
request's id. Bytes travel base64-encoded (file contents, command output, the diff). Errors come back typed
(`PathError`, `OSError`, `Error`) with the message meant for the model; the client re-raises them as the same
exceptions.

Request:  {"id": 7, "method": "read_bytes", "params": {"path": "a.py"}}
Response: {"id": 7, "result": ...}  or  {"id": 7, "error": {"type": "PathError", "message": "..."}}

**Why the channel needs protecting.** Everything the session starts runs as the same uid, in the same user and
pid namespaces, so sandboxed code can name the session's file descriptors — `/proc/PID/fd/N`, `pidfd_getfd`,
ptrace — and those of bwrap's init (pid 1). Through the reply pipe it could forge the answer to a call in
flight (the grader's test `run`: the reward), kill the host's reader with one line of garbage, or grow host
memory with one endless line; through the request pipe it could steal or inject requests. Hence:

* **Private pipes.** The protocol runs on two pipes passed to bwrap as extra descriptors (numbers in `main`'s
  arguments); bwrap's stdio is /dev/null. bwrap's init closes every descriptor but stdio, so pid 1 holds no end
  of them, and the session marks them close-on-exec, so no process it starts inherits one.
* **A non-dumpable session.** `main` first calls `prctl(PR_SET_DUMPABLE, 0)`. The kernel then refuses
  `/proc/PID/fd`, `/proc/PID/mem`, `pidfd_getfd` and ptrace to every process without `CAP_SYS_PTRACE` in the
  session's user namespace — and nothing in the sandbox has a capability (`--cap-drop ALL`, uid 1000 there).
  The session refuses to serve if the call fails. Processes it starts become dumpable again at their `exec`,
  by which time the protocol descriptors are closed in them.
* **Sealed lines.** Every line in either direction is `HMAC-SHA256(key, json) json`, keyed per session and per
  direction from a random secret the host writes as the first line, before anything else runs in the sandbox;
  it lives only in the two processes' memory. A line that does not verify is ignored, so even a descriptor
  that leaked some other way could not forge a reply or inject a request.
* **Bounded lines.** Both sides read with `read_lines`: a line over `MAX_LINE_BYTES` (room for base64 of a
  `MAX_FILE_BYTES` file plus envelope) is dropped as it streams by, never accumulated. The session never sends
  a longer reply: a result over the limit becomes an `OSError` (EFBIG) saying what to ask for instead.

**Why the session watches its own state.** Non-dumpable does not stop what the kernel allows any process of the
same uid: `prlimit` on the session (lower its file-size or CPU limit, say), `renice`/`chrt -i`
(SCHED_IDLE)/`taskset`/`ionice` on any of its threads, and signals. Every process the session starts inherits these
— a grader's test `run` would run with a 4 KB file limit, or at idle priority on one CPU. So `main` records them at
start, before anything else runs in the sandbox (`ProcessState`: `/proc/self/limits`, and the nice value, policy,
CPUs and I/O priority of its main thread, which every worker thread copies). Before every request it compares the
limits (one `pread`; lowered limits could fail any request, a write over the file-size limit say), and before and
after each `run`/`spawn` also the scheduling of the thread doing it, which the processes it starts inherit (its
command may be what changed them): ~10 µs, ~20 µs for a `run`. On any change it answers `SessionTampered` (with
`done`: whether it did the work) and exits. It does not repair itself: hard limits and the nice value cannot be
raised back without privileges, and whoever changed them could do it again. The host restarts the session, which
kills every process in the sandbox, and sends the call again when it was not done (`shipyard.sandbox.sandbox`).
Signals: those that end a process end the session (SIGINT too: its KeyboardInterrupt handler is removed), and the
host restarts it; SIGSTOP cannot be caught, so the host watches the session's state in `/proc` instead (SIGTSTP and
co. are dropped by the kernel: the session's process group is orphaned). bwrap's init (pid 1) ignores SIGSTOP and
SIGKILL sent from inside its pid namespace. Out of the sandbox's reach altogether: the session's `oom_score_adj`,
`autogroup` and `timerslack_ns` (their /proc files belong to root while it is non-dumpable), and its cgroup (a
cgroup namespace, and no cgroupfs inside).

This module must import nothing outside the standard library and `shipyard.harness.{workspace,confined,diff,process}`:
inside the sandbox only the interpreter's stdlib and shipyard's own source are guaranteed.
"""

from __future__ import annotations

import base64
import ctypes
import dataclasses
import errno
import hashlib
import hmac
import json
import os
import platform
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

from shipyard.harness.process import Job
from shipyard.harness.workspace import MAX_FILE_BYTES, LocalWorkspace, PathError

# The longest line either side reads or sends: base64 of a MAX_FILE_BYTES file (4/3 of it) plus envelope, with
# room to spare. A reply that would be longer is refused by the session; a line that is longer is dropped.
MAX_LINE_BYTES = 32 << 20
TAG_LEN = 64  # hex HMAC-SHA256
PR_SET_DUMPABLE, PR_GET_DUMPABLE = 4, 3


def channel_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(request key, reply key): one per direction, so a line can never be replayed the other way."""
    return (hmac.new(secret, b"shipyard request", hashlib.sha256).digest(),
            hmac.new(secret, b"shipyard reply", hashlib.sha256).digest())


def seal(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).hexdigest().encode() + b" " + payload + b"\n"


def unseal(key: bytes, line: bytes) -> bytes | None:
    """The payload of a line sealed with `key`, or None for anything else."""
    if len(line) <= TAG_LEN + 1 or line[TAG_LEN:TAG_LEN + 1] != b" ":
        return None
    payload = line[TAG_LEN + 1:]
    expected = hmac.new(key, payload, hashlib.sha256).hexdigest().encode()
    return payload if hmac.compare_digest(line[:TAG_LEN], expected) else None


def read_lines(fd: int, limit: int = MAX_LINE_BYTES) -> Iterator[bytes | None]:
    """Lines from `fd` (without their newline) until end of file or a read error. A line longer than `limit`
    is skipped as it streams by and yields None once: it costs a counter, never more than `limit` bytes."""
    buf = bytearray()
    skipping = False
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            return
        if not chunk:
            return  # a last line without its newline is incomplete: dropped
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                if not skipping:
                    buf += chunk[start:]
                    if len(buf) > limit:
                        skipping = True
                        buf.clear()
                        yield None
                break
            if skipping:
                skipping = False
            else:
                buf += chunk[start:end]
                line = bytes(buf) if len(buf) <= limit else None
                buf.clear()
                yield line
            start = end + 1


def make_undumpable() -> None:
    """Put this process's descriptors, memory and ptrace out of reach of same-uid processes without
    CAP_SYS_PTRACE (see the module docstring); raise if the kernel did not take it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed: the exec session will not serve "
                                          "with its channel reachable from the sandbox")


IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "riscv64": 31}.get(platform.machine())  # no ioprio in `os`
_libc = ctypes.CDLL(None, use_errno=True)


def thread_state() -> tuple[int, int, frozenset[int], int]:
    """What the calling thread passes on to the processes it starts and a same-uid process may change: (nice,
    scheduling policy, CPUs, I/O priority), all per thread on Linux."""
    ioprio = _libc.syscall(IOPRIO_GET, 1, 0) if IOPRIO_GET is not None else 0  # IOPRIO_WHO_PROCESS, this thread
    return os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0), frozenset(os.sched_getaffinity(0)), ioprio


@dataclass(frozen=True)
class ProcessState:
    """The session's limits and scheduling as the host started it (see the module docstring). Limits are read from
    `/proc/self/limits` (one `pread` for all of them). A thread's scheduling is compared with the main thread's at
    start, which every worker thread copies when it is created: a worker made after the main thread was changed
    differs too."""

    limits_fd: int
    limits: bytes
    thread: tuple[int, int, frozenset[int], int]

    @classmethod
    def record(cls) -> ProcessState:
        fd = os.open("/proc/self/limits", os.O_RDONLY | os.O_CLOEXEC)
        return cls(fd, os.pread(fd, 1 << 16, 0), thread_state())

    def changed(self, thread: bool) -> str | None:
        """What differs now from the record — the process's limits, and with `thread` the calling thread's
        scheduling — or None if nothing."""
        limits = os.pread(self.limits_fd, 1 << 16, 0)
        if limits != self.limits:
            was = self.limits.decode().splitlines()
            return "limits (now: " + "; ".join(" ".join(line.split()) for line in limits.decode().splitlines()
                                               if line not in was) + ")"
        now = thread_state() if thread else self.thread
        if now != self.thread:
            labels = ("nice value", "scheduling policy", "CPUs", "I/O priority")
            return f"thread {threading.get_native_id()}'s " + ", ".join(
                f"{label} from {sorted(a) if isinstance(a, frozenset) else a} to "
                f"{sorted(b) if isinstance(b, frozenset) else b}"
                for label, a, b in zip(labels, self.thread, now, strict=True) if a != b)
        return None


def tampered(change: str, done: bool) -> dict[str, Any]:
    return {"error": {"type": "SessionTampered", "done": done,
                      "message": f"a process in the sandbox changed the exec session's {change} (prlimit, renice, "
                                 "chrt, taskset or ionice on it), which every command it starts would inherit"}}


class Session:
    def __init__(self, root: str, baseline: str):
        self.ws = LocalWorkspace(root, baseline=baseline)
        self.jobs: dict[int, Job] = {}

    def call(self, method: str, p: dict[str, Any]) -> Any:
        ws = self.ws
        match method:
            case "ping":
                return "pong"
            case "environment":
                return ws.environment()
            case "resolve":
                return ws.resolve(p["path"])
            case "kind":
                return ws.kind(p["path"])
            case "read_bytes":
                data = ws.read_bytes(p["path"])
                if len(data) > MAX_FILE_BYTES:  # whatever the workspace let through, nothing bigger crosses
                    raise OSError(errno.EFBIG, f"{p['path']} is {len(data)} bytes, more than the {MAX_FILE_BYTES} "
                                               "a read may return; read part of it in the shell (e.g. `head -c "
                                               "100000 FILE` or `sed -n 1,200p FILE`)")
                return base64.b64encode(data).decode()
            case "write_bytes":
                return ws.write_bytes(p["path"], base64.b64decode(p["data"]))
            case "delete":
                return ws.delete(p["path"])
            case "listdir":
                return [dataclasses.asdict(e) for e in ws.listdir(p["path"])]
            case "glob":
                return ws.glob(p["pattern"], p["path"])
            case "files":
                return ws.files(p["limit"])
            case "run":
                stdin = base64.b64decode(p["stdin"]) if p.get("stdin") is not None else None
                r = ws.run(p["argv"], timeout=p["timeout"], cwd=p.get("cwd"), env=p.get("env"), stdin=stdin)
                return {**dataclasses.asdict(r), "output": base64.b64encode(r.output).decode()}
            case "spawn":
                job = ws.spawn(p["command"], cwd=p["cwd"], env=p["env"])
                self.jobs[job.id] = job
                return {"id": job.id, "pid": job.pid, "log": job.log}
            case "job_running":
                return self.jobs[p["id"]].running()
            case "job_stop":
                return self.jobs[p["id"]].stop()
            case "diff":  # base64: JSON escapes could make a bounded patch several times its size on the wire
                return base64.b64encode(ws.diff().encode()).decode()
        raise ValueError(f"unknown method {method!r}")


def encode_reply(req_id: int, method: str, outcome: dict[str, Any]) -> bytes:
    """One reply's JSON, or, when it would not fit on a line, an EFBIG error saying so."""
    data = json.dumps({"id": req_id, **outcome}).encode()
    if len(data) + TAG_LEN + 2 <= MAX_LINE_BYTES:
        return data
    message = (f"the result of {method} is {len(data)} bytes, more than the {MAX_LINE_BYTES} that may cross from "
               "the sandbox to the host; ask for less (e.g. read part of a large file with `head -c` or `sed -n`)")
    return json.dumps({"id": req_id, "error": {"type": "OSError", "errno": errno.EFBIG, "message": message}}).encode()


def parse_request(payload: bytes) -> dict[str, Any] | None:
    try:
        req = json.loads(payload)
    except ValueError:
        return None
    if (not isinstance(req, dict) or type(req.get("id")) is not int or not isinstance(req.get("method"), str)
            or not isinstance(req.get("params", {}), dict)):
        return None
    return req


def main(request_fd: int, reply_fd: int, root: str = "/workspace", baseline: str = "/snapshot") -> None:
    make_undumpable()  # before anything else: nothing else runs in the sandbox yet
    state = ProcessState.record()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # not a KeyboardInterrupt that waits for the calls in flight
    for fd in (request_fd, reply_fd):
        os.set_inheritable(fd, False)
    out = os.fdopen(reply_fd, "wb")
    os.dup2(2, 1)  # stray prints go where stderr goes (/dev/null), never onto the channel
    lines = read_lines(request_fd)
    try:
        secret = bytes.fromhex((next(lines, None) or b"").decode())
    except ValueError:
        secret = b""
    if len(secret) < 16:
        sys.exit("the first line from the host must be the channel secret: at least 16 random bytes, in hex")
    request_key, reply_key = channel_keys(secret)
    session = Session(root, baseline)
    lock = threading.Lock()

    def reply(data: bytes) -> None:
        data = seal(reply_key, data)
        with lock:
            out.write(data)
            out.flush()

    def refuse(req_id: int, method: str, change: str, done: bool) -> NoReturn:
        """Answer `SessionTampered` and stop serving: the host starts a clean session."""
        try:
            reply(encode_reply(req_id, method, tampered(change, done)))
        finally:
            os._exit(3)

    def handle(req: dict[str, Any]) -> None:
        req_id, method = req["id"], req["method"]
        starts_processes = method in ("run", "spawn")
        change = state.changed(thread=starts_processes)
        if change is not None:  # before doing anything: the host restarts the session and sends the call again
            refuse(req_id, method, change, done=False)
        try:
            outcome: dict[str, Any] = {"result": session.call(method, req.get("params", {}))}
        except PathError as e:
            outcome = {"error": {"type": "PathError", "message": str(e)}}
        except OSError as e:  # without its "[Errno N]" prefix, which the host's OSError(errno, message) adds back
            message = str(e) if e.strerror is None else e.strerror + (f": {e.filename!r}" if e.filename else "")
            outcome = {"error": {"type": "OSError", "errno": e.errno, "message": message}}
        except Exception as e:  # a bug here must reach the caller, not kill the session
            outcome = {"error": {"type": "Error", "message": f"{type(e).__name__}: {e}"}}
        # What a command changed while it ran (or just before its process started) must not reach the next one.
        change = state.changed(thread=True) if starts_processes else None
        if change is not None:
            refuse(req_id, method, change, done=True)
        try:
            data = encode_reply(req_id, method, outcome)
        except (TypeError, ValueError) as e:
            data = encode_reply(req_id, method, {"error": {"type": "Error", "message": f"unencodable result: {e}"}})
        reply(data)

    with ThreadPoolExecutor(max_workers=64) as pool:
        for line in lines:
            payload = unseal(request_key, line) if line is not None else None
            req = parse_request(payload) if payload is not None else None
            if req is not None:  # anything else did not come from the host: ignored
                pool.submit(handle, req)
    session.ws.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
