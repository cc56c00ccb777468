"""Review of issue 14: a sandbox of the environment server that cannot restart is an infrastructure failure on the
client too (`EnvServerError`, an `InfraError`), as `SandboxFailed` is locally — not a `RuntimeError` that escapes the
agent loop and fails the whole run."""

from __future__ import annotations

import contextlib

import pytest
from servers import needs_sandbox, running_app

from shipyard.httpguard import new_token
from shipyard.models.errors import InfraError
from shipyard.sandbox.client import EnvClient
from shipyard.sandbox.host import host
from shipyard.sandbox.server import ServerConfig, create_app
from shipyard.sandbox.snapshot import remove_snapshot

pytestmark = needs_sandbox


def test_a_remote_sandbox_that_cannot_restart_is_an_infra_error(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    token = new_token()
    app = create_app(ServerConfig(token=token, allowed_roots=(tmp_path.resolve(),)))
    with contextlib.ExitStack() as stack:
        client = EnvClient(stack.enter_context(running_app(app)), retry_for=2, token=token)
        stack.callback(client.close)
        snap_id = client.snapshot(str(repo))
        sb = stack.enter_context(client.sandbox(snap_id))
        assert sb.run(["true"], timeout=10).exit_code == 0
        remove_snapshot(host().state_dir / "snapshots" / snap_id)  # the host lost it: no restart is possible
        with pytest.raises(InfraError):
            sb.run(["bash", "-c", "kill -9 -1"], timeout=10)  # the session dies; its restart fails
            sb.run(["true"], timeout=10)
