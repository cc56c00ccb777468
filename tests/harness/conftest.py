"""The tool tests run twice: against a local directory and against a sandbox over a snapshot of it."""

from __future__ import annotations

import pytest

from shipyard.harness.workspace import LocalWorkspace


@pytest.fixture(scope="session")
def sandbox_problem():
    from shipyard.sandbox.run import sandbox_problem

    return sandbox_problem()


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
    from shipyard.sandbox.snapshot import snapshot_of

    with snapshot_of(repo, host()) as snap, Sandbox(snap) as sandbox:
        yield sandbox
