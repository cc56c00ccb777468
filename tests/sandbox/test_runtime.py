"""Sandboxes see the Python environment shipyard runs in: its interpreter, its `rg` and `ruff` (a venv install)."""

import os
import sys

import pytest
from test_security import _problem, nothing_left

from shipyard.harness.tools import ToolContext
from shipyard.harness.tools.files import grep
from shipyard.harness.tools.lint import read_lints
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot

pytestmark = pytest.mark.skipif(_problem is not None, reason=f"this host cannot start bubblewrap sandboxes: {_problem}")


@pytest.fixture
def sandbox(repo):
    snap = make_snapshot(repo, host())
    try:
        with Sandbox(snap) as sb:
            yield sb
    finally:
        remove_snapshot(snap)
    assert nothing_left()


def test_sandbox_runs_the_environment_shipyard_runs_in(sandbox):
    out = sandbox.run(["python", "-c", "import sys, pytest; print(sys.prefix)"], timeout=60)
    assert out.exit_code == 0, out.output
    assert out.output.decode().strip() == os.path.abspath(sys.prefix)  # the venv itself, when there is one
    for tool in ("rg", "ruff"):
        found = sandbox.run(["bash", "-c", f"command -v {tool}"], timeout=30)
        assert found.exit_code == 0, f"{tool} is not on the sandbox's PATH: {found.output!r}"
        assert found.output.decode().startswith(os.path.abspath(sys.prefix) + "/bin/") or sys.prefix == sys.base_prefix


def test_grep_and_read_lints_work_in_a_sandbox(sandbox):
    ctx = ToolContext(sandbox)
    assert "pocketlib/roman.py:" in grep(ctx, "def to_roman")
    sandbox.write_bytes("bad.py", b"import os\n")
    assert "bad.py:1:8: F401" in read_lints(ctx, ["bad.py"])
