"""Child processes that end with the process that started them.

shipyard starts long-lived children from a process that can itself be killed outright: sandboxes (bwrap) from an
episode's tool calls, vLLM servers (7 GB each) from a run, trainer ranks from rank 0, a benchmark's stages (a whole
`shipyard eval` with its own server and sandboxes) from `shipyard bench`. A SIGKILL, the OOM killer or a plain SIGTERM
(which ends a Python process without running its `finally` blocks) gives the parent no chance to stop them, and
before this they ran on: a killed `bench learning` left its evaluation sampling for an hour.

The kernel can do it instead. `PR_SET_PDEATHSIG` (prctl(2)) asks for a signal when the *thread* that forked the
child ends, and is kept across `execve` (except into a set-uid program). Two parts:

- `die_with_parent(argv)` wraps a command in a one-line Python boot that sets it, checks that its parent is still
  the process that meant to start it (the parent may have died between the fork and the prctl, and the signal is
  then never sent), restores the signals Python ignores at start-up (SIGPIPE, SIGXFSZ: an ignored signal stays
  ignored across `exec`), then `exec`s the command, which keeps the boot's pid, so the caller's `Popen` handle is the
  command's own. The boot's interpreter is isolated (`-I -S`): it imports only the standard library and reads no
  environment variable meant for the command. bwrap has this built in (`--die-with-parent`).
- `popen(argv, …)` forks from one thread that lives as long as the process (the "launcher"), because the signal
  follows the forking *thread*: a server restarted from an agent's short-lived worker thread, or a sandbox started
  from a tool call's, was killed when that thread ended. The launcher is a daemon thread, never joined, so it ends
  with the process itself and not at the start of interpreter shutdown, while other threads may still use the
  children (an executor's worker would be joined there). A forked child gets a launcher of its own (the parent's
  thread does not exist there). A caller interrupted while waiting (Ctrl-C) never leaves a child it has no handle
  on: the child, once forked, is killed.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

_BOOT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, int(sys.argv[1])); "  # 1: PR_SET_PDEATHSIG
         "os.getppid() == int(sys.argv[2]) or sys.exit('shipyard: the process that started this one is gone'); "
         "signal.signal(signal.SIGPIPE, signal.SIG_DFL); signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
         "try:\n    os.execvp(sys.argv[3], sys.argv[3:])\n"
         "except OSError as e:\n    sys.stderr.write(f'shipyard: cannot run {sys.argv[3]}: {e}\\n'); os._exit(127)")


def die_with_parent(argv: Sequence[str], on_parent_death: signal.Signals = signal.SIGTERM) -> list[str]:
    """`argv` as a command that receives `on_parent_death` when the thread that forks it ends (module docstring):
    start it with `popen` (forked from a thread that ends before the boot's prctl, the child would be handed to
    another thread of this process, pass the parent check and never be signalled). SIGTERM lets the child clean up
    (a server stops its workers); SIGKILL for a child with nothing to clean up."""
    return [sys.executable, "-I", "-S", "-c", _BOOT, str(int(on_parent_death)), str(os.getpid()), *map(str, argv)]


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(argv, **kwargs)`, forked from the launcher thread, which lives as long as this process."""
    forked: Future[subprocess.Popen] = Future()
    _launcher().put((list(argv), kwargs, forked))
    try:
        return forked.result()
    except BaseException:
        forked.add_done_callback(_kill_unclaimed)  # interrupted: the child it may still fork has no owner
        raise


def _kill_unclaimed(forked: Future[subprocess.Popen]) -> None:
    if not forked.cancelled() and forked.exception() is None:
        proc = forked.result()
        proc.kill()
        proc.wait()


def _serve(requests: queue.SimpleQueue) -> None:
    while True:
        argv, kwargs, forked = requests.get()
        if forked.set_running_or_notify_cancel():
            try:
                forked.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as e:
                forked.set_exception(e)


_requests: queue.SimpleQueue | None = None
_lock = threading.Lock()


def _launcher() -> queue.SimpleQueue:
    """The queue of this process's launcher thread, started on first use."""
    global _requests
    with _lock:
        if _requests is None:
            _requests = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_requests,), name="shipyard-launcher", daemon=True).start()
        return _requests


def _forget_launcher() -> None:
    """In a forked child: the parent's launcher thread (and any holder of the lock) does not exist here."""
    global _requests, _lock
    _requests, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_launcher)
