"""The tool tests run twice: against a local directory and against a sandbox over a snapshot of it."""

from __future__ import annotations

import tempfile

import pytest

from shipyard.harness.workspace import LocalWorkspace


def _sandbox_problem() -> str | None:
    from shipyard.sandbox.host import host
    from shipyard.sandbox.run import run_in_sandbox
    from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot

    try:
        snap = make_snapshot(tempfile.mkdtemp(), host())
        probe = run_in_sandbox(snap, ["true"], timeout=30)
        remove_snapshot(snap)
    except (OSError, RuntimeError) as e:
        return str(e)
    return None if probe.exit_code == 0 else probe.output.decode(errors="replace")


@pytest.fixture(scope="session")
def sandbox_problem():
    return _sandbox_problem()


@pytest.fixture(params=["local", "sandbox"])
def ws(request, repo, sandbox_problem):
    if request.param == "local":
        w = LocalWorkspace(repo)
        yield w
        w.close()
        return
    if sandbox_problem:
        pytest.skip(f"this host cannot start bubblewrap sandboxes: {sandbox_problem}")
    from shipyard.sandbox.host import host
    from shipyard.sandbox.sandbox import Sandbox
    from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot

    snap = make_snapshot(repo, host())
    sandbox = Sandbox(snap)
    yield sandbox
    sandbox.close()
    remove_snapshot(snap)
