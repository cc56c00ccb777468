"""Sandboxes see the Python environment shipyard runs in: its interpreter, its `rg` and `ruff` (a venv install)."""

import os
import subprocess
import sys
from pathlib import Path

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


def test_a_state_directory_of_another_user_is_refused(tmp_path):
    """What the state dir holds (the runtime farm, shipyard's source for the exec session) runs in every sandbox:
    another local user who made or owns it could plant code there."""
    if os.geteuid() == 0:
        state = tmp_path / "theirs"
        state.mkdir()
        os.chown(state, 65534, 65534)
    else:
        state = Path("/usr")  # root's
    code = "from shipyard.sandbox.host import host; host()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SHIPYARD_SANDBOX_STATE": str(state)})
    assert proc.returncode != 0 and "belongs to uid" in proc.stderr, proc.stderr[-1000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")
def test_snapshots_and_upper_dirs_are_closed_to_other_local_users(tmp_path):
    """A tree readable only through its 0700 ancestor stays unreadable to other users once snapshotted."""
    src = tmp_path / "private" / "proj"
    src.mkdir(parents=True)
    (src / "notes.txt").write_text("private notes\n")
    (src / "notes.txt").chmod(0o644)
    (tmp_path / "private").chmod(0o700)
    snap = make_snapshot(src, host())
    try:
        with Sandbox(snap) as sb:
            sb.write_bytes("written.txt", b"episode data\n")
            for path in (snap / "notes.txt", sb.layout.upper / "written.txt"):
                r = subprocess.run(["setpriv", "--reuid=65533", "--regid=65533", "--clear-groups", "cat", str(path)],
                                   capture_output=True, text=True)
                assert r.returncode != 0 and "Permission denied" in r.stderr, (path, r.stdout)
    finally:
        remove_snapshot(snap)
