"""A real run directory for the dashboard's tests: `shipyard train` (a subprocess, as a user runs it) with the tiny
random model as the policy and a replay engine as the sampler, whose scripted turns make what the dashboard must
show — two parallel calls in a turn, edits (a diff), a test-configuration write the monitors flag, hints (targeted
feedback is on) — over the example repository's task set. Made once per test session (~1 minute); tests that change
a run work on a copy."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shipyard.sandbox.run import sandbox_problem

TURNS = [
    'Looking around first.\n<tool_call>\n{"name": "list_dir", "arguments": {"path": "tests"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call>',
    'Now the edits.\n<tool_call>\n{"name": "search_replace", "arguments": {"path": "README.md", "old_string": '
    '"# pocketlib", "new_string": "# pocketlib (checked)"}}\n</tool_call>\n<tool_call>\n{"name": "write_file", '
    '"arguments": {"path": "tests/conftest.py", "content": "import pytest\\n"}}\n</tool_call>',
    "Done: the README says it was checked.",
]

CONFIG = """
[model]
name = "random:tiny"

[engine]
kind = "replay:{replay}"

[run]
tasks = "{tasks}"
held_out_count = 1
steps = 2
seed = 1
eval_every = 1
eval_samples = 1
checkpoint_every = 2

[rollout]
group_size = 2
groups_per_step = 1
max_staleness = 2
max_in_flight = 1
dynamic_sampling = false

[episode]
grade_timeout = 300.0

[episode.loop]
max_turns = 3
max_new_tokens = 400

[trainer.optim]
name = "adamw"
lr = 1e-3

[trainer.distill]
teacher = "live"

[hints]
enabled = true
"""


@pytest.fixture(scope="session")
def dash_run(taskset, tmp_path_factory) -> Path:
    """A finished run directory (see the module docstring)."""
    problem = sandbox_problem()
    if problem is not None:
        pytest.skip(f"this host cannot start bubblewrap sandboxes: {problem}")
    root = tmp_path_factory.mktemp("dashboard")
    replay = root / "replay.jsonl"
    replay.write_text("".join(json.dumps(t) + "\n" for t in TURNS))
    config = root / "run.toml"
    config.write_text(CONFIG.format(replay=replay, tasks=taskset[0]))
    run = root / "runs" / "tiny"
    proc = subprocess.run([sys.executable, "-m", "shipyard.cli", "train", str(config), "--run.dir", str(run)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture
def run_copy(dash_run, tmp_path) -> Path:
    """A copy of the run, under a runs folder of its own, for a test that changes it."""
    dest = tmp_path / "runs" / dash_run.name
    shutil.copytree(dash_run, dest, ignore=shutil.ignore_patterns("checkpoints", "export", "tb"))
    return dest
