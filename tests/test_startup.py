"""Commands that use no model import no torch or transformers (~5 s per process on a loaded 2-core machine)."""

import os
import subprocess
import sys

import pytest
from servers import needs_sandbox

HEAVY = ("torch", "transformers")


def imported(*args: str, cwd=None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `shipyard ARGS` with -X importtime; the top-level packages it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "shipyard.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines()
             if line.startswith("import time:") and line.count("|") == 2}
    return proc, names


@needs_sandbox
def test_sandbox_exec_imports_no_model_libraries(repo):
    proc, names = imported("sandbox", "exec", "--repo", str(repo), "--", "true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "shipyard" in names and not names & set(HEAVY), sorted(names & set(HEAVY))


@pytest.mark.parametrize("args", [
    ["grade", "--tasks", "{tmp}", "--task", "missing", "--patch", "{tmp}/p.diff"],
    ["synth", "--repo", "{tmp}/missing", "--out", "{tmp}/out"],
    ["env-server", "--help"],
    ["sandbox", "exec", "--help"],
])
def test_task_and_server_commands_import_no_model_libraries(args, tmp_path):
    (tmp_path / "p.diff").write_text("")
    proc, names = imported(*(a.format(tmp=tmp_path) for a in args))
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not names & set(HEAVY), f"{args[0]} imported {sorted(names & set(HEAVY))}"
