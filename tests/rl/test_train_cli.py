"""`shipyard train CONFIG.toml` as a user runs it (a real subprocess): a run directory with everything in it, and a
run killed with SIGKILL mid-run that resumes (`--run.resume true`) and ends exactly as the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from shipyard.sandbox.run import sandbox_problem

_problem = sandbox_problem()
pytestmark = pytest.mark.skipif(_problem is not None, reason=f"this host cannot start bubblewrap sandboxes: {_problem}")

CONFIG = """
[model]
name = "random:tiny"

[run]
tasks = "{tasks}"
held_out_count = 1
steps = 3
seed = 1
eval_samples = 1
checkpoint_every = 1

[rollout]
group_size = 2
groups_per_step = 1
max_staleness = 0
max_in_flight = 1
dynamic_sampling = false

[episode]
grade_timeout = 300.0

[episode.loop]
max_turns = 2
max_new_tokens = 12
seed = 0

[trainer.optim]
name = "adamw"
lr = 1e-3
"""


def shipyard(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "shipyard.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def weights(run: Path) -> dict:
    return load_file(run / "export" / "model.safetensors")


@pytest.mark.slow  # ~3 minutes: three training runs
def test_train_writes_a_run_and_a_killed_run_resumes_to_the_same_end(taskset, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(tasks=taskset[0]))

    whole = shipyard("train", str(config), "--run.dir", str(tmp_path / "whole"))
    out, err = whole.communicate(timeout=900)
    assert whole.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["steps"] == 3 and len(summary["evals"]) == 2  # before the first step and after the last
    run = tmp_path / "whole"
    for name in ("config.toml", "run.json", "metrics.jsonl", "rollouts.jsonl", "tb", "export", "checkpoints"):
        assert (run / name).exists(), name
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    assert 'held_out = [' in (run / "config.toml").read_text()  # the split is recorded

    cut = tmp_path / "cut"
    victim = shipyard("train", str(config), "--run.dir", str(cut), start_new_session=True)
    deadline = time.monotonic() + 600
    while not (cut / "checkpoints" / "step-00000001").exists():  # step 1 is saved: kill it during step 2
        assert victim.poll() is None and time.monotonic() < deadline, victim.communicate()[1][-3000:]
        time.sleep(0.2)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate()
    resumed = shipyard("train", str(config), "--run.dir", str(cut), "--run.resume", "true")
    out, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err[-3000:]
    a, b = weights(run), weights(cut)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    lines = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    reference = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for mine, theirs in zip(lines, reference, strict=True):
        for key in ("reward/mean", "train/loss", "episode/sampled_tokens"):
            assert mine.get(key) == theirs.get(key), (mine["step"], key)


def test_train_refuses_a_run_directory_in_use_and_a_bad_override(taskset, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(tasks=taskset[0]))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes").write_text("x")
    proc = shipyard("train", str(config), "--run.dir", str(tmp_path / "busy"))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "not empty" in err
    proc = shipyard("train", str(config), "--run.stepz", "4")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "--run.steps" in err
