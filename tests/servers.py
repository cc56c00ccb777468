"""Real servers for tests: a free loopback port, an ASGI app on a real uvicorn server for a with-block, and whether a
server's (or any) process still runs.

Imported by test modules as `from servers import alive, free_port, running_app, wait_for` (pytest puts `tests/` on
`sys.path` for its root conftest)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie waiting for its reaper runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(predicate, timeout: float = 30.0) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; whether it held (assert on the result)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


@contextlib.contextmanager
def running_app(app, startup: float = 30.0) -> Iterator[str]:
    """Run an ASGI app on a real uvicorn server on 127.0.0.1 (in a thread) for the with-block; yields its base URL.
    The server stops (its lifespan shutdown runs) when the block ends."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.02)
    if not server.started:
        raise RuntimeError(f"uvicorn did not start on 127.0.0.1:{port} within {startup} s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def _sandbox_problem() -> str | None:
    from shipyard.sandbox.run import sandbox_problem

    return sandbox_problem()


_SANDBOX_PROBLEM = _sandbox_problem()  # probed once per test process
# Tests that start bubblewrap sandboxes skip themselves, saying why, on a host that cannot start them.
needs_sandbox = pytest.mark.skipif(_SANDBOX_PROBLEM is not None,
                                   reason=f"this host cannot start bubblewrap sandboxes: {_SANDBOX_PROBLEM}")
