"""One task set synthesized from the example repository, shared by every test module of tests/tasks that needs it.

Synthesis runs the suite in sandboxes several times (≈ 25 s), so it is made once per test session; tests only read
it, and each test that grades makes its own sandboxes. Modules that use it skip themselves where bubblewrap cannot
start (see the skip marker in test_synth_grade.py), so the fixture itself never runs on such hosts.
"""

import shutil
from pathlib import Path

import pytest

from shipyard.tasks.synth import SynthConfig, Synthesizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pocketlib"


@pytest.fixture(scope="session")
def taskset(tmp_path_factory):
    """(task set directory, synthesis report, the repository it was made from): three tasks, one per tier."""
    repo = tmp_path_factory.mktemp("src") / "pocketlib"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__", ".ruff_cache", ".benchmarks"))
    out = tmp_path_factory.mktemp("tasks")
    report = Synthesizer(repo, out, SynthConfig(max_tasks=3), log=lambda m: None).run()
    return out, report, repo
