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
import torch
from safetensors.torch import load_file
from servers import needs_sandbox
from tiny_run import CONFIG

pytestmark = needs_sandbox


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


def train(config: Path, run: Path, *args: str) -> str:
    proc = shipyard("train", str(config), "--run.dir", str(run), *args)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_train_on_two_ranks_checkpoints_the_shards_of_two(taskset, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(tasks=taskset[0]))
    run = tmp_path / "two"
    train(config, run, "--run.world_size", "2", "--run.steps", "1")
    step = run / "checkpoints" / "step-00000001"
    assert json.loads((step / "trainer.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in (step / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (run / "export" / "model.safetensors").exists()
    assert json.loads((run / "run.json").read_text())["status"] == "finished"


@pytest.mark.slow  # ~4 minutes: four training runs
def test_a_run_resumes_on_another_number_of_ranks_and_ends_where_one_rank_does(taskset, tmp_path):
    """1 rank for 3 steps against: 2 ranks for step 1, resumed on 1 rank for step 2, resumed on 2 ranks for step 3.
    A step on 2 ranks equals one on 1 rank but for the order of float sums, so the weights agree to float accuracy
    and the rollouts (sampled from the synced weights with the same seeds) are the same."""
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(tasks=taskset[0]))
    whole, chain = tmp_path / "whole", tmp_path / "chain"
    train(config, whole)
    every = ("--run.keep_checkpoints", "0")  # each step's checkpoint is read below
    train(config, chain, "--run.world_size", "2", "--run.steps", "1", *every)
    train(config, chain, "--run.world_size", "1", "--run.steps", "2", "--run.resume", "true", *every)
    train(config, chain, "--run.world_size", "2", "--run.steps", "3", "--run.resume", "true", *every)
    sizes = [json.loads((chain / "checkpoints" / f"step-0000000{s}" / "trainer.json").read_text())["world_size"]
             for s in (1, 2, 3)]
    assert sizes == [2, 1, 2]
    a, b = weights(whole), weights(chain)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5), (k, (a[k] - b[k]).abs().max())
    lines = [json.loads(x) for x in (chain / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    for mine, theirs in zip(lines, reference, strict=True):
        assert mine.get("episode/sampled_tokens") == theirs.get("episode/sampled_tokens"), mine["step"]


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


def test_train_with_hints_writes_them_and_distils_on_the_hinted_turns(taskset, tmp_path):
    """The tiny random model writes no call, so its first turn is a final answer with nothing changed: the
    `finished` detector hints that turn, the EMA teacher is built (distillation follows hints.enabled) and the step
    distils into the turn's tokens; the hints are in the metrics and beside the trajectories."""
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(tasks=taskset[0]))
    run = tmp_path / "hinted"
    # every hint kept whatever its lift: the random model's lift has either sign
    train(config, run, "--run.steps", "1", "--hints.enabled", "true", "--trainer.distill.min_lift", "-1e9")
    assert "enabled = true" in (run / "config.toml").read_text().split("[trainer.distill]")[1].split("[")[0]
    step = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1]
    assert step["hints/count"] >= 1 and step["hints/found_finished_unchanged"] >= 1
    assert step["train/distill_tokens"] > 0 and step["train/distill_loss"] >= 0
    assert step["train/hints"] == step["train/hints_kept"] == step["hints/count"]
    assert "train/hint_lift" in step and "train/hint_lift_finished_unchanged" in step
    records = [json.loads(x) for x in (run / "trajectories" / "step-000001.jsonl").read_text().splitlines()]
    hinted = [h for r in records for h in r["hints"]]
    assert hinted and all(h["text"] and h["kinds"] and h["evidence"] for h in hinted)
    assert "finished_unchanged" in hinted[0]["kinds"] and "nothing was changed" in hinted[0]["text"]


# A bug planted in the trainer's step (the one library function replaced; everything else is the real command).
PLANTED = """
import sys

from shipyard.cli import app
from shipyard.train.trainer import Trainer


def planted(self, batch):
    raise ValueError("a planted bug in the trainer step")


Trainer.step = planted
app(prog_name="shipyard")
"""


def test_a_bug_in_a_training_step_is_a_traceback_and_a_failed_run(taskset, tmp_path):
    """A ValueError deep in a run is a bug, not a user mistake: printed with its traceback (not as one "error:"
    line), written to RUN/error.txt, the run marked failed in run.json, and an exit status other than 2."""
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(tasks=taskset[0]))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", PLANTED, "train", str(config), "--run.dir", str(run),
                           "--run.steps", "1"], capture_output=True, text=True, timeout=900)
    assert proc.returncode not in (0, 2), (proc.returncode, proc.stderr[-3000:])
    assert "Traceback (most recent call last)" in proc.stderr, proc.stderr[-3000:]
    assert "ValueError: a planted bug in the trainer step" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith("error:")], proc.stderr[-3000:]
    error = (run / "error.txt").read_text()
    assert error.startswith("Traceback (most recent call last)") and "in planted" in error
    assert error.rstrip().endswith("ValueError: a planted bug in the trainer step")
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "failed" and status["error"] == "ValueError: a planted bug in the trainer step"


def test_a_bad_configuration_value_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text(CONFIG.format(tasks=tmp_path / "tasks").replace("steps = 3", "steps = 0"))
    proc = shipyard("train", str(config), "--run.dir", str(tmp_path / "run"))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "steps" in lines[0] and "at least 1" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before anything was made


# The host's sandbox probe planted to fail (the one library function replaced; everything else is the real command).
NO_SANDBOXES = """
import shipyard.sandbox.run
from shipyard.cli import app

shipyard.sandbox.run.sandbox_problem = lambda: "planted: user namespaces are disabled"
app(prog_name="shipyard")
"""


def test_train_on_a_host_that_cannot_start_sandboxes_stops_before_anything(tmp_path):
    """`shipyard train` opens its sandboxes as `shipyard eval` does (`shipyard.rollout.setup`), so the host's probe
    runs first: a host that cannot start sandboxes is one error line and exit 2, before the task set is read, the
    model loaded or the run directory made — not a run in which every episode fails as an infrastructure error."""
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(tasks=tmp_path / "tasks"))  # no task set there: the probe comes before it is read
    command = [sys.executable, "-c", NO_SANDBOXES, "train", str(config), "--run.dir", str(tmp_path / "run")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: this host cannot start bubblewrap sandboxes: planted: user namespaces are disabled" in proc.stderr
    assert "Traceback" not in proc.stderr and "holds no tasks" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
