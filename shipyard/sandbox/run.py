"""One command in a fresh sandbox over a snapshot (what `shipyard sandbox exec` does)."""

from __future__ import annotations

import uuid
from pathlib import Path

from shipyard.harness.process import ExecResult, run_process
from shipyard.sandbox.bwrap import WORKSPACE, Cgroups, Limits, bwrap_argv, preexec
from shipyard.sandbox.host import host
from shipyard.sandbox.layout import Layout


def run_in_sandbox(snapshot: Path, command: list[str], *, timeout: float, limits: Limits | None = None,
                   env: dict[str, str] | None = None, cwd: str = WORKSPACE, max_output: int = 1 << 20) -> ExecResult:
    """Run `command` in a new sandbox whose workspace is an overlay over `snapshot`; discard its changes."""
    h = host()
    limits = limits or Limits()
    layout = Layout.create(h, uuid.uuid4().hex[:12], limits.disk_mb)
    try:
        cgroups = Cgroups(h, limits)
    except BaseException:
        layout.remove()
        raise
    try:
        argv = bwrap_argv(h, layout, snapshot, command, cwd=cwd, env=env)
        return run_process(argv, timeout=timeout, cwd="/", env={}, max_output=max_output,
                           preexec_fn=preexec(h, limits, cgroups))
    finally:
        cgroups.remove()
        layout.remove()


def sandbox_problem() -> str | None:
    """Why sandboxes cannot start on this host (bwrap missing, user namespaces disabled, …), or None."""
    import tempfile

    from shipyard.sandbox.snapshot import snapshot_of

    try:
        with tempfile.TemporaryDirectory(prefix="shipyard-probe-") as empty, snapshot_of(empty, host()) as snapshot:
            probe = run_in_sandbox(snapshot, ["true"], timeout=30)
    except (OSError, RuntimeError) as e:
        return str(e)
    return None if probe.exit_code == 0 else probe.output.decode(errors="replace").strip()
