"""The tool tests run twice: against a local directory and against a sandbox over a snapshot of it."""

from __future__ import annotations

import pytest
from servers import needs_sandbox

from shipyard.harness.workspace import LocalWorkspace


@pytest.fixture(params=["local", pytest.param("sandbox", marks=needs_sandbox)])
def ws(request, repo):
    if request.param == "local":
        w = LocalWorkspace(repo)
        yield w
        w.close()
        return
    from shipyard.sandbox.host import host
    from shipyard.sandbox.sandbox import Sandbox
    from shipyard.sandbox.snapshot import snapshot_of

    with snapshot_of(repo, host()) as snap, Sandbox(snap) as sandbox:
        yield sandbox
