"""`shipyard demo`: the report it draws from a run's metrics lines, its configuration, and — as a user runs it — the
whole loop with a tiny random model, which has nothing to learn from and must say so with a non-zero exit."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console
from servers import needs_sandbox

from shipyard.rl.demo import DEMO_CONFIG, demo_config, report

EVAL0 = {"step": 0, "eval/scored": 4, "eval/reward_mean": 0.0, "eval/pass@1": 0.0, "eval/grounded_fraction": 0.0,
         "eval/tool_calls": 12, "eval/placeholder_calls": 3, "eval/untagged_grounded_calls": 5,
         "eval/flagged_rollouts": 0}


def step(n, *, signal=0.2, grounded=0.1, flagged=0, skipped=False, evaluated=None, loss=0.01, grad=0.5, lr=1e-6):
    line = {"step": n, "reward/advantage_abs_mean": signal, "tools/grounded_fraction": grounded,
            "train/policy_loss": loss, "train/grad_norm": grad, "train/lr": lr,
            "episode/parallel_width_mean": 1.5, "monitor/flagged": flagged, "time/step_seconds": 100.0 + n,
            "memory/peak_rss_mb": 1000.0 * n}
    if skipped:
        line["train/skipped"] = 1.0
    return {**line, **{k: v for k, v in (evaluated or {}).items() if k.startswith("eval/")}}


def test_report_reads_before_after_and_training_figures():
    after = {**EVAL0, "eval/grounded_fraction": 0.25,
             "eval/reward_mean": 0.5, "eval/pass@1": 0.5}
    lines = [EVAL0, step(1, grounded=0.0), step(2, flagged=1), step(3, grounded=0.5, evaluated=after)]
    r = report(lines, steps=3)
    assert r.ok and r.failures == []
    assert (r.trained_steps, r.hack_flags, r.train_grounded, r.peak_rss_mb) == (3, 1, (0.0, 0.5), 3000.0)
    assert r.seconds_per_step == pytest.approx(102.0) and r.parallel_width == pytest.approx(1.5)
    rows = dict((label, (b, a)) for label, b, a in r.rows())
    assert rows["grounded tool-call validity"] == ("0.000", "0.250")
    assert rows["pass rate (pass@1)"] == ("0.000", "0.500")
    assert rows["rollouts scored / flagged"] == ("4 / 0", "4 / 0")
    held_out, training = r.tables()  # pass@1 moved: no verdict before the tables
    assert r.verdict() is None
    assert (held_out.row_count, training.row_count) == (len(r.rows()), len(r.training_rows()))
    assert json.loads(json.dumps(r.to_json()))["ok"] is True


def _shown(renderables) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(*renderables)
    return console.export_text()


def test_an_unmoved_pass_rate_is_explained_first_and_points_to_the_learning_bench():
    r = report([EVAL0, step(1), step(2, evaluated={**EVAL0, "eval/grounded_fraction": 0.25})], steps=2)
    assert r.ok  # the loop worked; the model did not learn to solve
    verdict = r.verdict()
    assert verdict.startswith("pass@1 did not move (0.000 → 0.000): the model solves none of these tasks before "
                              "training, and RL needs successes to learn from")
    assert "shipyard bench learning" in verdict and "docs/benchmarks.md" in verdict and "shipyard sft" in verdict
    text = _shown(r.tables())
    assert text.index("pass@1 did not move") < text.index("held-out tasks, before and after") \
        < text.index("seconds per step")  # the first lines of the summary
    assert r.to_json()["verdict"] == verdict
    # a rate above 0 that did not move: too few steps and rollouts, said with the figures
    half = {**EVAL0, "eval/pass@1": 0.5}
    r = report([half, step(1), step(2, evaluated=half)], steps=2)
    assert r.verdict().startswith("pass@1 did not move (0.500 → 0.500): 2 trainer step(s), evaluated on 4 held-out "
                                  "rollouts, are too few to move it")
    full = {**EVAL0, "eval/pass@1": 1.0}
    assert "already solves every one" in report([full, step(1, evaluated=full)], steps=1).verdict()
    # no evaluation after training: nothing to explain (the failure says what happened)
    assert report([EVAL0, step(1)], steps=1).verdict() is None


def test_a_run_its_time_budget_ended_is_not_a_failure():
    lines = [EVAL0, step(1), {**step(2, evaluated=EVAL0), "run/stopped_at_budget": 1}]
    r = report(lines, steps=5)
    assert r.ok, r.failures
    assert not report([EVAL0, step(1), step(2, evaluated=EVAL0)], steps=5).ok  # without the budget: steps missing


@pytest.mark.parametrize("lines, steps, failure", [
    ([step(1), step(2)], 2, "expected an evaluation before and after"),
    ([EVAL0, step(1, evaluated={**EVAL0, "eval/scored": 0})], 1, "after training scored no rollout"),
    ([{**EVAL0, "eval/scored": 0}, step(1, evaluated=EVAL0)], 1, "before training scored no rollout"),
    ([EVAL0, step(1, evaluated=EVAL0)], 2, "logged 1 of 2 trainer steps"),
    ([EVAL0, step(1, signal=0.0), step(2, skipped=True, evaluated=EVAL0)], 2, "no trainer step had a learning signal"),
    ([EVAL0, step(1, loss=float("nan"), evaluated=EVAL0)], 1, "non-finite loss"),
    ([EVAL0, step(1, grad=float("inf"), evaluated=EVAL0)], 1, "the trainer diverged"),
    ([EVAL0, step(1, lr=0.0), step(2, grad=0.0, evaluated=EVAL0)], 2, "no trainer step moved the weights"),
])
def test_report_fails_when_the_loop_did(lines, steps, failure):
    r = report(lines, steps)
    assert not r.ok and any(failure in f for f in r.failures), r.failures


def test_demo_config_is_the_checked_in_file_in_a_fresh_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("SHIPYARD_HOME", str(tmp_path))
    config = demo_config(["--run.steps", "1"])
    assert config.run.steps == 1 and config.run.dir.parent == tmp_path / "runs"
    assert config.run.synth_from == DEMO_CONFIG.parent.parent / "examples" / "pocketlib"
    assert config.shaping.grounded > 0 and config.hints.enabled is False and config.trainer.optim.name == "adamw"
    assert config.trainer.micro_batch >= config.rollout.group_size  # a group's shared prompt computed once
    assert demo_config(["--run.dir", str(tmp_path / "mine")]).run.dir == tmp_path / "mine"


@pytest.mark.slow  # ~1-2 minutes: a real run with sandboxes
@needs_sandbox
def test_demo_with_a_model_that_learns_nothing_prints_its_table_and_fails(taskset, tmp_path):
    args = ["--model.name", "random:tiny", "--run.tasks", str(taskset[0]), "--run.dir", str(tmp_path / "run"),
            "--run.steps", "1", "--run.held_out_count", "1", "--run.eval_samples", "1", "--run.checkpoint_every", "1",
            "--rollout.group_size", "2", "--rollout.max_refills", "0", "--episode.loop.max_turns", "1",
            "--episode.loop.max_new_tokens", "8", "--trainer.micro_batch", "2",
            "--episode.loop.max_tokens", "12288"]  # the byte tokenizer's first prompt is ~7k tokens, the 0.5B's ~1.7k
    proc = subprocess.run([sys.executable, "-m", "shipyard.cli", "demo", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "160",
                                            "SHIPYARD_HOME": str(tmp_path / "home")})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "held-out tasks, before and after training" in proc.stderr and "seconds per step" in proc.stderr
    assert "the loop failed" in proc.stderr and "no trainer step had a learning signal" in proc.stderr
    assert proc.stderr.index("pass@1 did not move") < proc.stderr.index("held-out tasks, before and after")
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["ok"] is False and doc["steps"] == 1 and doc["before"]["eval/scored"] == 1
    assert (tmp_path / "run" / "export" / "model.safetensors").exists()  # the loop itself ran to its end
