"""`Sandbox`: a `Workspace` whose files and processes live in a bubblewrap sandbox over a snapshot.

A sandbox is one long-lived bwrap process running the exec session (`shipyard.sandbox.session`) over an
overlay of its own upper dir on the shared read-only snapshot. Every `Workspace` method is one JSON-lines
request to that session, so tools run unchanged against it. If the session dies (killed by a limit, say), it
is restarted over the same upper dir — files survive, background jobs do not — and the call in flight fails
with `SessionRestarted`, which tools report to the model like any other OS error.

A session that does not answer is put down the same way, never waited on again: sandboxed code can stop it
(SIGSTOP; non-dumpable does not stop signals). Every call reads the session's state in `/proc/PID/stat` before it
is sent, and every `TICK` while its reply is late (the session is the only child of bwrap's only child: its host
pid is found once, after its first answer, while nothing else runs in the sandbox). A stopped session, or a reply
that does not come within the call's wait, means the session is killed and restarted; a call not yet sent then
goes to the new session, one in flight fails with `SessionRestarted`. Requests go through a non-blocking pipe
with the same checks, so a session that stopped reading cannot block a caller, nor the callers queued behind it.
The session guards its own limits and scheduling (see `shipyard.sandbox.session`): when sandboxed code changed
them it answers `SessionTampered` and exits; the host restarts it and sends the call again if the session said it
had not done it. So no later call hangs, and none runs with limits or priorities the sandbox lowered. Cost per
call: a `pread` here (~6-10 µs) and one in the session (~10 µs; ~20 µs of checks for a `run`); nothing more while
replies come within `TICK`.

The channel is hostile ground: the sandbox's code runs as the session's uid. It travels on two pipes that only
the session holds (bwrap's stdio is /dev/null), the session is non-dumpable, and every line is sealed with a
per-session key (see `shipyard.sandbox.session`). The host's reader still trusts nothing it reads: it takes
lines of at most `MAX_LINE_BYTES` (longer ones are dropped as they stream by), and a line that is not a
sealed, well-formed reply to a call in flight is counted in `ignored_lines` and otherwise ignored — the reader
never dies of its input, so one bad line cannot stall every later call. Requests over the limit are refused
before they are sent. So host memory per call is bounded by the line limit, whatever the sandbox writes.

Closing a sandbox kills every process in it (through its cgroup where the host has one, else through the
pid namespace dying with bwrap), then removes its cgroups and its upper dir.
"""

from __future__ import annotations

import base64
import compileall
import contextlib
import errno
import hashlib
import itertools
import json
import os
import secrets
import select
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import shipyard
from shipyard.harness.process import ExecResult, Job, kill_group
from shipyard.harness.workspace import Entry, Kind, PathError
from shipyard.lifetime import popen
from shipyard.models.errors import InfraError
from shipyard.sandbox.bwrap import WORKSPACE, Cgroups, Limits, bwrap_argv, preexec
from shipyard.sandbox.host import Host, host
from shipyard.sandbox.layout import Layout
from shipyard.sandbox.session import MAX_LINE_BYTES, channel_keys, read_lines, seal, unseal
from shipyard.sandbox.snapshot import snapshot_episode

SOURCE_MOUNT = "/opt/shipyard"
TICK = 0.2  # seconds between checks that a session a call waits on is not stopped
class SandboxFailed(InfraError, RuntimeError):
    """The sandbox is gone: its exec session could not be started (or restarted after dying), or it was used after
    `close()`. An `InfraError`: an episode that meets it ends with `infra_error`, its trajectory kept."""


class SessionRestarted(OSError):
    """The exec session died during a call; it was restarted over the same files (background jobs are gone)."""


AGAIN = "it was restarted over the same files (background jobs were lost)"
RESTARTED = f"the sandbox's exec session died; {AGAIN}"


@dataclass
class _Channel:
    """The host's end of one session process: its request pipe (a non-blocking descriptor), the per-session keys,
    its calls in flight, and the session's `/proc/PID/stat`. Each session has its own, so a dead session's reader
    can only fail the calls that were sent to it."""

    requests: int
    request_key: bytes
    reply_key: bytes
    pending: dict[int, Future] = field(default_factory=dict)
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    stat_fd: int | None = None
    stat_lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def write(self, line: bytes, unresponsive: Callable[[], str | None]) -> None:
        """Write one whole line. While the pipe is full, ask `unresponsive` every `TICK` why to give up, if so."""
        view = memoryview(line)
        poll = None
        with self.write_lock:  # held to the line's end: lines never interleave
            if self.closed:
                raise SessionRestarted(RESTARTED)
            while view:
                try:
                    view = view[os.write(self.requests, view):]
                except BlockingIOError:
                    why = unresponsive()
                    if why is not None:
                        raise SessionRestarted(why) from None
                    if poll is None:
                        poll = select.poll()
                        poll.register(self.requests, select.POLLOUT)
                    poll.poll(TICK * 1000)
                except OSError:  # EPIPE: the session is gone
                    raise SessionRestarted(RESTARTED) from None

    def stopped(self) -> bool:
        """Whether the session is stopped (SIGSTOP from inside the sandbox, say): it would answer nothing."""
        with self.stat_lock:
            if self.stat_fd is None:
                return False
            try:
                stat = os.pread(self.stat_fd, 512, 0)
            except OSError:  # gone: its reader sees the pipe close
                return False
        state = stat.rfind(b")") + 2  # after "pid (comm) "
        return stat[state:state + 1] in (b"T", b"t")

    def close(self) -> None:
        """Close both descriptors; called once the session is dead, so no writer holds `write_lock` for long."""
        with self.write_lock, self.stat_lock:
            if not self.closed:
                self.closed = True
                for fd in (self.requests, self.stat_fd):
                    if fd is not None:
                        with contextlib.suppress(OSError):
                            os.close(fd)
                self.stat_fd = None


def session_stat(bwrap_pid: int) -> int | None:
    """An open `/proc/PID/stat` of the session bwrap `bwrap_pid` runs: the only child of bwrap's only child (its
    init), as long as nothing else runs in the sandbox — before the session's first answer. None where the kernel
    does not list children (no CONFIG_PROC_CHILDREN): then only calls' waits catch a stopped session."""
    pid = bwrap_pid
    for _ in range(2):
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        if len(children) != 1:
            return None
        pid = int(children[0])
    try:
        return os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def tampered(reply: dict[str, Any]) -> bool:
    """Whether a reply says the session found its limits or scheduling changed, and exited."""
    error = reply.get("error")
    return isinstance(error, dict) and error["type"] == "SessionTampered"


def parse_reply(line: bytes | None, key: bytes) -> dict[str, Any] | None:
    """A line from the reply pipe → a reply envelope, or None for anything the session did not send."""
    payload = unseal(key, line) if line is not None else None
    if payload is None:
        return None
    try:
        reply = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if not isinstance(reply, dict) or type(reply.get("id")) is not int:
        return None
    error = reply.get("error")
    if "result" not in reply and not (isinstance(error, dict) and isinstance(error.get("type"), str)
                                      and isinstance(error.get("message"), str)):
        return None
    return reply


@cache
def shipyard_source(h: Host) -> Path:
    """A copy of shipyard's (pure-Python) package the sandbox uid can read; the session imports it. Compiled here:
    the sandbox cannot write bytecode next to it, and compiling at every session start cost ~60 ms."""
    package = Path(shipyard.__file__).resolve().parent
    files = sorted(p for p in package.rglob("*.py"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:16]
    dest = h.state_dir / "src" / digest
    if dest.exists():
        return dest
    # Processes (two test runs, a server and a CLI) and threads (a server's starters) may build it at once: each
    # builds its own partial copy and publishes it with one rename; a loser finds the winner's in place and uses it.
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(dest.parent, dest.parent.stat().st_mode & 0o7777 | 0o555)  # a+rX: the sandbox uid traverses it
    for stale in dest.parent.glob("*.partial-*"):  # left by a killed build: its pid is gone
        pid = stale.name.split(".partial-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = dest.with_name(f"{digest}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        # symlinks=True: a checkout's shipyard/examples links to the example repository (data no session imports,
        # and rglob above does not follow the link); copied as the link, so the copy is what the digest names.
        shutil.copytree(package, tmp / "shipyard", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        compileall.compile_dir(tmp / "shipyard", quiet=1, ddir=f"{SOURCE_MOUNT}/shipyard")
        subprocess.run(["chmod", "-R", "a+rX", str(tmp)], check=True)
        os.rename(tmp, dest)  # fails once another build is in place (a non-empty directory)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        if not dest.is_dir():  # only a rename publishes it, so one that exists is complete
            raise
    return dest


class SessionWorkspace:
    """The `Workspace` protocol over the exec session's request set; subclasses supply the transport (`_call`)."""

    exec_root = WORKSPACE

    def _call(self, method: str, wait: float = 120, **params: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def _unwrap(reply: dict[str, Any]) -> Any:
        """A session reply envelope → its result, or the exception it carries (as the tools expect it)."""
        if "error" in reply:
            err = reply["error"]
            if err["type"] == "PathError":
                raise PathError(err["message"])
            if err["type"] == "OSError":
                raise OSError(err.get("errno") or 0, err["message"])
            raise RuntimeError(f"sandbox session error: {err['message']}")
        return reply["result"]

    def resolve(self, path: str) -> str:
        if not isinstance(path, str) or not path.strip():
            raise PathError("path must be a non-empty string (relative to the workspace root, e.g. 'src/app.py')")
        return self._call("resolve", path=path)

    def kind(self, path: str) -> Kind:
        return self._call("kind", path=path)

    def read_bytes(self, path: str) -> bytes:
        return base64.b64decode(self._call("read_bytes", path=path))

    def write_bytes(self, path: str, data: bytes) -> None:
        self._call("write_bytes", path=path, data=base64.b64encode(data).decode())

    def delete(self, path: str) -> None:
        self._call("delete", path=path)

    def listdir(self, path: str) -> list[Entry]:
        return [Entry(**e) for e in self._call("listdir", path=path)]

    def glob(self, pattern: str, path: str) -> list[str]:
        return self._call("glob", pattern=pattern, path=path)

    def files(self, limit: int) -> list[str]:
        return self._call("files", limit=limit)

    def environment(self) -> dict[str, str]:
        return self._call("environment")

    def run(self, argv: list[str], *, timeout: float, cwd: str | None = None, env: dict[str, str] | None = None,
            stdin: bytes | None = None) -> ExecResult:
        r = self._call("run", wait=timeout + 60, argv=argv, cwd=cwd, env=env, timeout=timeout,
                       stdin=base64.b64encode(stdin).decode() if stdin is not None else None)
        return ExecResult(base64.b64decode(r["output"]), r["exit_code"], r["timed_out"], r["seconds"],
                          r["dropped_bytes"])

    def spawn(self, command: list[str], *, cwd: str, env: dict[str, str]) -> Job:
        info = self._call("spawn", command=command, cwd=cwd, env=env)
        job_id = info["id"]
        return Job(job_id, " ".join(command), info["pid"], info["log"],
                   lambda: bool(self._call("job_running", id=job_id)), lambda: self._call("job_stop", id=job_id))

    def diff(self) -> str:
        return base64.b64decode(self._call("diff", wait=600)).decode()


class Sandbox(SessionWorkspace):
    def __init__(self, snapshot: str | Path, limits: Limits | None = None, sandbox_id: str | None = None):
        self.h = host()
        self.snapshot = Path(snapshot)
        self.limits = limits or Limits()
        self.id = sandbox_id or uuid.uuid4().hex[:12]
        self.layout = Layout.create(self.h, self.id, self.limits.disk_mb)
        try:
            self.cgroups = Cgroups(self.h, self.limits)
        except BaseException:  # a sandbox that fails to start leaves nothing behind
            self.layout.remove()
            raise
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._restart_lock = threading.RLock()
        self._proc: subprocess.Popen | None = None
        self._closed = False
        self.restarts = 0
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # Session process ----------------------------------------------------------------------------------------
    _channel: _Channel | None = None
    ignored_lines = 0  # lines on the reply pipe that were not a sealed reply to a call in flight

    def _start(self) -> None:
        """Start a session and wait for its first answer; raise `SandboxFailed` if it does not give one."""
        if self._channel is not None:
            self._channel.close()
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        python = f"{self.h.python_prefix}/bin/python3"
        code = (f"import sys; sys.path.insert(0, {SOURCE_MOUNT!r}); from shipyard.sandbox.session import main; "
                f"main({request_read}, {reply_write})")
        argv = bwrap_argv(self.h, self.layout, self.snapshot, [python, "-I", "-S", "-c", code],
                          extra_ro_binds=((str(shipyard_source(self.h)), SOURCE_MOUNT),))
        try:
            # The protocol pipes are extra descriptors: bwrap's init (pid 1) keeps only stdio, here /dev/null.
            # bwrap --die-with-parent: the kernel's signal follows the thread that forks it (`shipyard.lifetime`),
            # so a session started from a tool call's worker thread would die with that thread
            proc = popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         pass_fds=(request_read, reply_write), cwd="/", env={}, start_new_session=True,
                         preexec_fn=preexec(self.h, self.limits, self.cgroups))
        except BaseException as e:
            os.close(request_write)
            os.close(reply_read)
            if isinstance(e, OSError):  # out of descriptors or processes on the host: not the model's doing
                raise SandboxFailed(f"the exec session of sandbox {self.id} could not be started: {e}") from e
            raise
        finally:
            os.close(request_read)
            os.close(reply_write)
        os.set_blocking(request_write, False)
        secret = secrets.token_bytes(32)
        channel = _Channel(request_write, *channel_keys(secret))
        threading.Thread(target=self._read, args=(reply_read, channel), daemon=True).start()
        try:
            # The first line, before anything else runs in the sandbox, and before a call can see this channel.
            channel.write(secret.hex().encode() + b"\n", lambda: "the exec session did not read its key")
            self._proc, self._channel, self._pending = proc, channel, channel.pending
            self._unwrap(self._send(channel, "ping", 30, {}))
            channel.stat_fd = session_stat(proc.pid)
        except (OSError, ValueError) as e:
            if not isinstance(e, SessionRestarted):
                problem = f"{type(e).__name__}: {e}"
            else:
                # its reply pipe closed (RESTARTED) as it exited, which may be before it is reaped
                exited = str(e) == RESTARTED or proc.poll() is not None
                problem = "it exited before answering" if exited else "it did not answer in 30 s"
            kill_group(proc.pid)
            proc.wait()
            channel.close()
            raise SandboxFailed(f"the exec session of sandbox {self.id} did not start ({problem}); "
                               "check that this host can start sandboxes: `shipyard sandbox exec --repo DIR -- "
                               "true`") from None

    def _read(self, fd: int, channel: _Channel) -> None:
        """The reply pipe's reader: every sealed reply goes to its call; anything else is counted, never fatal."""
        try:
            for line in read_lines(fd, MAX_LINE_BYTES):
                reply = parse_reply(line, channel.reply_key)
                with self._lock:
                    fut = channel.pending.pop(reply["id"], None) if reply is not None else None
                    if fut is None:
                        self.ignored_lines += 1
                if fut is not None:
                    fut.set_result(reply)
        finally:
            os.close(fd)
            with self._lock:  # the session is gone: fail everything still waiting on it
                failed = list(channel.pending.values())
                channel.pending.clear()
            for fut in failed:
                fut.set_exception(SessionRestarted(RESTARTED))

    def _send(self, channel: _Channel, method: str, wait: float, params: dict[str, Any]) -> dict[str, Any]:
        """Send one request to `channel`'s session and wait for its reply envelope (no restart here)."""
        req_id = next(self._ids)
        line = seal(channel.request_key, json.dumps({"id": req_id, "method": method, "params": params}).encode())
        if len(line) > MAX_LINE_BYTES:
            raise OSError(errno.EFBIG, f"the {method} request is {len(line)} bytes, more than the {MAX_LINE_BYTES} "
                                       "that may be sent to a sandbox at once; send less (e.g. a large file in parts)")
        deadline = time.monotonic() + wait

        def unresponsive() -> str | None:
            if channel.stopped():
                return f"the sandbox's exec session was stopped (by a signal from the sandbox) during {method}; {AGAIN}"
            if time.monotonic() >= deadline:
                return f"the sandbox's exec session did not answer {method} within {wait:g} s; {AGAIN}"
            return None

        fut: Future = Future()
        with self._lock:
            channel.pending[req_id] = fut
        try:
            channel.write(line, unresponsive)
            while True:
                try:
                    return fut.result(timeout=max(0.0, min(TICK, deadline - time.monotonic())))
                except TimeoutError:
                    why = unresponsive()
                    if why is not None:
                        raise SessionRestarted(why) from None
        finally:
            with self._lock:
                channel.pending.pop(req_id, None)

    def _exchange(self, method: str, wait: float, params: dict[str, Any]) -> tuple[_Channel, dict[str, Any]]:
        """One call on the current session, restarted first if it died or was stopped between calls, and after
        the call if it died, stopped or did not answer during it (then the call fails with `SessionRestarted`)."""
        channel = self._channel
        if self._proc.poll() is not None or channel.stopped():  # nothing sent yet: restart, then send
            self._restart(channel)
            channel = self._channel
        try:
            return channel, self._send(channel, method, wait, params)
        except SessionRestarted:
            self._restart(channel)
            raise

    def _call(self, method: str, wait: float = 120, **params: Any) -> Any:
        if self._closed:
            raise SandboxFailed(f"sandbox {self.id} is closed")
        channel, reply = self._exchange(method, wait, params)
        if tampered(reply):  # the session exited: restart it; send the call again if it had not started it
            self._restart(channel)
            if reply["error"].get("done") is False:
                channel, reply = self._exchange(method, wait, params)
                if tampered(reply):  # a fresh session found so too: not something a restart fixes
                    self._restart(channel)
            if tampered(reply):
                raise SessionRestarted(f"{reply['error']['message']}; {AGAIN}")
        return self._unwrap(reply)

    def _restart(self, dead: _Channel) -> None:
        """Put down the session of channel `dead` — exited, stopped, unresponsive or tampered with; bwrap may outlive
        its session by a moment — and start a new one, unless another call already did."""
        with self._restart_lock:  # parallel calls that failed together restart the session once
            if self._closed or dead is not self._channel:
                return
            if self._proc is not None:
                kill_group(self._proc.pid)
                self._proc.wait()
            self.cgroups.kill_all()
            self.restarts += 1
            self._start()

    def save_snapshot(self, name: str | None = None) -> Path:
        """The workspace as it is now, as a new snapshot (the caller owns it: `remove_snapshot` when done)."""
        return snapshot_episode(self.snapshot, self.layout.upper, self.h, name)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._proc is not None:
            kill_group(self._proc.pid)
            self._proc.wait()
        if self._channel is not None:
            self._channel.close()
        self.cgroups.remove()
        self.layout.remove()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
