"""`Sandbox`: a `Workspace` whose files and processes live in a bubblewrap sandbox over a snapshot.

A sandbox is one long-lived bwrap process running the exec session (`shipyard.sandbox.session`) over an
overlay of its own upper dir on the shared read-only snapshot. Every `Workspace` method is one JSON-lines
request to that session, so tools run unchanged against it. If the session dies (killed by a limit, say), it
is restarted over the same upper dir — files survive, background jobs do not — and the call in flight fails
with `SessionRestarted`, which tools report to the model like any other OS error.

Closing a sandbox kills every process in it (through its cgroup where the host has one, else through the
pid namespace dying with bwrap), then removes its cgroups and its upper dir.
"""

from __future__ import annotations

import base64
import compileall
import hashlib
import itertools
import json
import shutil
import subprocess
import threading
import uuid
from concurrent.futures import Future
from functools import cache
from pathlib import Path
from typing import Any

import shipyard
from shipyard.harness.process import ExecResult, Job, kill_group
from shipyard.harness.workspace import Entry, Kind, PathError
from shipyard.sandbox.bwrap import WORKSPACE, Cgroups, Limits, bwrap_argv, preexec
from shipyard.sandbox.host import Host, host
from shipyard.sandbox.layout import Layout
from shipyard.sandbox.snapshot import snapshot_episode

SOURCE_MOUNT = "/opt/shipyard"


class SessionRestarted(OSError):
    """The exec session died during a call; it was restarted over the same files (background jobs are gone)."""


@cache
def shipyard_source(h: Host) -> Path:
    """A copy of shipyard's (pure-Python) package the sandbox uid can read; the session imports it. Compiled here:
    the sandbox cannot write bytecode next to it, and compiling at every session start cost ~60 ms."""
    package = Path(shipyard.__file__).resolve().parent
    files = sorted(p for p in package.rglob("*.py"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()[:16]
    dest = h.state_dir / "src" / digest
    if not dest.exists():
        tmp = dest.with_name(digest + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(package, tmp / "shipyard", ignore=shutil.ignore_patterns("__pycache__"))
        compileall.compile_dir(tmp / "shipyard", quiet=1, ddir=f"{SOURCE_MOUNT}/shipyard")
        subprocess.run(["chmod", "-R", "a+rX", str(tmp), str(tmp.parent)], check=True)
        tmp.replace(dest)
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
        return self._call("diff", wait=600)


class Sandbox(SessionWorkspace):
    def __init__(self, snapshot: str | Path, limits: Limits | None = None, sandbox_id: str | None = None):
        self.h = host()
        self.snapshot = Path(snapshot)
        self.limits = limits or Limits()
        self.id = sandbox_id or uuid.uuid4().hex[:12]
        self.layout = Layout.create(self.h, self.id, self.limits.disk_mb)
        self.cgroups = Cgroups(self.h, self.limits)
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._restart_lock = threading.RLock()
        self._proc: subprocess.Popen | None = None
        self._closed = False
        self.restarts = 0
        self._start()

    # Session process ----------------------------------------------------------------------------------------
    def _start(self) -> None:
        python = f"{self.h.python_prefix}/bin/python3"
        code = f"import sys; sys.path.insert(0, {SOURCE_MOUNT!r}); from shipyard.sandbox.session import main; main()"
        argv = bwrap_argv(self.h, self.layout, self.snapshot, [python, "-I", "-S", "-c", code],
                          extra_ro_binds=((str(shipyard_source(self.h)), SOURCE_MOUNT),))
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      cwd="/", env={}, start_new_session=True,
                                      preexec_fn=preexec(self.h, self.limits, self.cgroups))
        # Each session process has its own table of calls in flight, so a dead session's reader can only fail
        # the calls that were sent to it, never those already sent to its replacement.
        self._pending = {}
        threading.Thread(target=self._read, args=(self._proc, self._pending), daemon=True).start()
        self._call("ping", wait=30)

    def _read(self, proc: subprocess.Popen, pending: dict[int, Future]) -> None:
        for line in proc.stdout:
            reply = json.loads(line)
            with self._lock:
                fut = pending.pop(reply["id"], None)
            if fut is not None:
                fut.set_result(reply)
        with self._lock:  # the session is gone: fail everything still waiting on it
            failed = list(pending.values())
            pending.clear()
        for fut in failed:
            fut.set_exception(SessionRestarted("the sandbox's exec session died; it was restarted over the same "
                                               "files (background jobs were lost)"))

    def _call(self, method: str, wait: float = 120, **params: Any) -> Any:
        if self._closed:
            raise RuntimeError(f"sandbox {self.id} is closed")
        if self._proc.poll() is not None:  # died between calls: restart before sending anything
            self._restart()
        req_id = next(self._ids)
        fut: Future = Future()
        with self._lock:
            pending = self._pending
            pending[req_id] = fut
        try:
            self._proc.stdin.write(json.dumps({"id": req_id, "method": method, "params": params}).encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            with self._lock:
                pending.pop(req_id, None)
            self._restart()
            raise SessionRestarted("the sandbox's exec session died; it was restarted over the same files "
                                   "(background jobs were lost)") from None
        try:
            reply = fut.result(timeout=wait)
        except SessionRestarted:
            self._restart()
            raise
        return self._unwrap(reply)

    def _restart(self) -> None:
        with self._restart_lock:  # parallel calls that failed together restart the session once
            if self._closed or (self._proc is not None and self._proc.poll() is None):
                return
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
        self.cgroups.remove()
        self.layout.remove()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
