"""Running processes for tools: bounded output, whole-process-group kills, background jobs.

Every process is started in its own session (`start_new_session=True`), so it and everything it forks form
one process group that a timeout kills as a unit. Output (stdout and stderr merged) is read from a pipe by
`BoundedCapture`, which keeps only the first and last `max_output` bytes and counts the rest: a command that
prints without end costs a counter, not memory or disk.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ExecResult:
    """A finished (or killed) process: combined output, exit code and whether it ran past its timeout.

    `output` holds at most the first and the last `max_output` bytes; `dropped_bytes` counts what was between.
    """

    output: bytes
    exit_code: int
    timed_out: bool
    seconds: float
    dropped_bytes: int = 0


class BoundedCapture:
    """Reads a pipe to its end on a thread, keeping only the first and last `keep` bytes."""

    def __init__(self, fd: int, keep: int):
        self.fd, self.keep = fd, keep
        self.head, self.tail = bytearray(), bytearray()
        self.total = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self.fd], [], [], 0.05)
            if not ready:
                if self.stop.is_set():
                    return  # something outside the killed group still holds the pipe open; stop listening
                continue
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return
            self.total += len(chunk)
            room = self.keep - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                self.tail += chunk
                del self.tail[: max(0, len(self.tail) - self.keep)]

    def finish(self, grace: float = 1.0) -> tuple[bytes, int]:
        self.thread.join(timeout=grace)
        self.stop.set()
        self.thread.join()
        os.close(self.fd)
        return bytes(self.head + self.tail), self.total - len(self.head) - len(self.tail)


def kill_group(pid: int) -> None:
    """SIGKILL a whole process group (its leader was started with `start_new_session=True`)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_process(argv: list[str], *, timeout: float, cwd: str | Path, env: dict[str, str] | None,
                stdin: bytes | None = None, max_output: int = 1 << 20,
                preexec_fn: Callable[[], None] | None = None) -> ExecResult:
    """Run `argv` with stdout+stderr merged; on timeout kill the process group and keep the partial output.

    `preexec_fn` runs in the child before exec (the sandbox launcher sets limits and drops privileges there).
    """
    start = time.monotonic()
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=write_fd, stderr=write_fd,
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=preexec_fn)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    capture = BoundedCapture(read_fd, max_output)
    timed_out = False
    try:
        proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc.pid)
        proc.wait()
    # Children left running in the group (e.g. `sleep 100 &` without a background request) die with it.
    kill_group(proc.pid)
    output, dropped = capture.finish()
    return ExecResult(output, proc.returncode, timed_out, time.monotonic() - start, dropped)


@dataclass
class Job:
    """A background process; its output goes to `log`, a path in the workspace's execution environment.

    `running` and `stop` are supplied by the workspace that started it (a local process or one in a sandbox).
    """

    id: int
    command: str
    pid: int
    log: str
    running: Callable[[], bool]
    stop: Callable[[], None]


def local_job(job_id: int, command: str, proc: subprocess.Popen, log: str) -> Job:
    def stop() -> None:
        kill_group(proc.pid)
        proc.wait()

    return Job(job_id, command, proc.pid, log, lambda: proc.poll() is None, stop)


def spawn_process(argv: list[str], *, cwd: str | Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start a background process in its own process group, its output appended to `log`."""
    with open(log, "ab") as fh:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
