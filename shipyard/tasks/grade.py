"""The grader: a patch's reward, from a fresh sandbox over the task's snapshot.

1. Reject patches that touch the environment (`.venv/`) or git internals: they are the agent's doing (reward 0).
2. Apply the patch with `git apply` in a fresh sandbox; a patch that does not apply scores 0.
3. Restore the test files and test configuration from the task's canonical copies, and delete any test file or
   test configuration the patch added (a new `conftest.py` can rewrite outcomes through pytest's hooks).
4. Run the suite with JUnit XML; every FAIL_TO_PASS and PASS_TO_PASS test must be reported (a missing one counts
   as failed) and pass. Reward 1 or 0, plus the fraction of those tests that passed.

Infrastructure failures (the sandbox would not start, its session died, pytest produced no report) come back as
`status: "infra_error"` with `reward: null` — never as a zero that would teach the policy something false. A suite
that runs past its timeout is the patch's doing (an infinite loop, say): `status: "timeout"`, reward 0.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot
from shipyard.tasks.features import is_test_file
from shipyard.tasks.suite import OUT, run_suite
from shipyard.tasks.taskset import Task

TEST_CONFIG = ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", ".coveragerc")
PATCH_PATHS = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
FORBIDDEN = (".venv/", ".git/")


@dataclass
class Verdict:
    task: str
    status: str  # graded | patch_rejected | patch_failed | timeout | infra_error
    reward: float | None
    passed_fraction: float = 0.0
    fail_to_pass: dict[str, int] = field(default_factory=dict)  # passed, total
    pass_to_pass: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # expected tests the run did not report
    failed: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    collection_errors: list[str] = field(default_factory=list)
    detail: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def is_test_config(path: str) -> bool:
    return is_test_file(path) or Path(path).name in TEST_CONFIG


def patch_paths(patch: str) -> list[str]:
    return sorted({p for m in PATCH_PATHS.finditer(patch) for p in m.groups()})


def _restore(ws: Sandbox, task: Task, task_dir: Path) -> tuple[list[str], list[str]]:
    restored = []
    for rel in task.test_files:
        canonical = (task_dir / "tests" / rel).read_bytes()
        if ws.kind(rel) != "file" or ws.read_bytes(rel) != canonical:
            ws.write_bytes(rel, canonical)
            restored.append(rel)
    known = set(task.test_files)
    removed = [rel for rel in ws.files(1_000_000) if is_test_config(rel) and rel not in known
               and not rel.startswith((".venv/", OUT))]
    for rel in removed:
        ws.delete(rel)
    return restored, removed


def grade(task: Task, task_dir: Path, patch: str, timeout: float = 900, snapshot: Path | None = None) -> Verdict:
    """Grade `patch`; `snapshot` is a ready sandbox snapshot of the task's `snapshot/` (made here when None)."""
    start = time.monotonic()
    verdict = Verdict(task.id, "graded", 0.0)
    bad = [p for p in patch_paths(patch) if p.startswith(FORBIDDEN)]
    if bad:
        verdict.status, verdict.detail = "patch_rejected", f"the patch edits the environment: {', '.join(bad[:5])}"
        return verdict
    snap = None
    try:
        if snapshot is None:
            snap = snapshot = make_snapshot(task_dir / "snapshot", host())
        with Sandbox(snapshot) as sb:
            if patch.strip():
                sb.write_bytes(f"{OUT}/patch.diff", patch.encode())
                r = sb.run(["git", "apply", "--whitespace=nowarn", f"{OUT}/patch.diff"], timeout=120)
                if r.exit_code != 0:
                    verdict.status, verdict.detail = "patch_failed", r.output.decode(errors="replace")[-2000:]
                    return verdict
            verdict.restored, verdict.removed = _restore(sb, task, task_dir)
            try:
                run = run_suite(sb, timeout=timeout)
            except TimeoutError as e:
                verdict.status, verdict.detail = "timeout", str(e)[-2000:]
                return verdict
    except (OSError, RuntimeError) as e:
        verdict.status, verdict.reward, verdict.detail = "infra_error", None, f"{type(e).__name__}: {e}"[-3000:]
        return verdict
    finally:
        if snap is not None:
            remove_snapshot(snap)
        verdict.seconds = round(time.monotonic() - start, 2)
    expected = [*task.fail_to_pass, *task.pass_to_pass]
    verdict.missing = [t for t in expected if t not in run.outcomes]
    passed = run.passed
    verdict.failed = [t for t in expected if t in run.outcomes and t not in passed]
    f2p = sum(t in passed for t in task.fail_to_pass)
    p2p = sum(t in passed for t in task.pass_to_pass)
    verdict.fail_to_pass = {"passed": f2p, "total": len(task.fail_to_pass)}
    verdict.pass_to_pass = {"passed": p2p, "total": len(task.pass_to_pass)}
    verdict.passed_fraction = round((f2p + p2p) / max(1, len(expected)), 4)
    verdict.reward = 1.0 if f2p + p2p == len(expected) else 0.0
    verdict.collection_errors = run.collection_errors
    return verdict
