"""`shipyard bench rollout_model` end to end with the tiny random model: the real scheduler, `LocalEngine`, real
sandboxes and real grading on the `taskset` fixture's tasks. Faults first: a directory that is not a task set ends with
one line saying so, not a traceback or made-up figures; a budget that expires at once is scored, never masked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from servers import needs_sandbox

TINY_RUN = ["--model", "random:tiny", "--group-size", "2", "--groups", "1", "--workers", "2", "--max-turns", "2",
            "--max-new-tokens", "16"]
pytestmark = needs_sandbox


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shipyard.bench.rollout_model", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_a_directory_that_is_not_a_task_set_is_one_line_before_any_model_loads(tmp_path):
    proc = bench("--tasks", str(tmp_path), *TINY_RUN, timeout=60)
    assert proc.returncode != 0
    assert "is not a task set" in proc.stderr and "Traceback" not in proc.stderr
    assert "loaded" not in proc.stderr  # it stopped before loading the model


def test_a_budget_that_expires_at_once_is_scored_not_masked(taskset):
    # The rollout budget is the agent's wall time: every episode stops at once and is graded (0), none is masked.
    tasks_dir, _, _ = taskset
    proc = bench("--tasks", str(tasks_dir), *TINY_RUN, "--steps", "1", "--rollout-budget", "0.000001")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fig["accepted"] == 2 and fig["passed"] == 0 and fig["infra"]["masked_infra"] == 0
    assert "cancelled" not in fig["statuses"] and "Traceback" not in proc.stderr


def test_train_mode_measures_real_rollouts_and_ends_with_its_figures(taskset, tmp_path):
    tasks_dir, _, _ = taskset
    out = tmp_path / "rollouts.jsonl"
    proc = bench("--tasks", str(tasks_dir), *TINY_RUN, "--steps", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fig["bench"] == "rollout_model" and fig["model"] == "random:tiny" and fig["config"]["mode"] == "train"
    assert fig["accepted"] == 4 and fig["rollouts"] >= 4  # two batches of one group of two; groups ahead may finish
    assert fig["rollouts_per_hour"] == pytest.approx(fig["rollouts"] / fig["wall_s"] * 3600, rel=0.02)
    assert fig["sampled_tokens"] > 0 and fig["tokens_per_s"] > 0
    assert 0 < fig["engine_busy"] <= 1 and fig["engine"]["decode_steps"] > 0
    assert 0 < fig["sandbox_utilisation"] <= 1  # every rollout was graded in a sandbox
    assert sum(fig["statuses"].values()) == fig["rollouts"] and fig["infra"]["masked_infra"] == 0
    assert fig["mean_turns"] >= 1 and fig["passed"] == 0  # random weights solve nothing
    assert all(int(k) >= 0 for k in fig["staleness_histogram"]) and 0 < fig["trained_token_fraction"] <= 1
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) >= fig["rollouts"] and all(line["status"] for line in lines)


def test_eval_mode_runs_one_group_per_task(taskset):
    tasks_dir, report, _ = taskset
    proc = bench("--tasks", str(tasks_dir), *TINY_RUN, "--mode", "eval", "--group-size", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fig["rollouts"] == fig["accepted"] == len(report.accepted)
    assert fig["sandbox_utilisation"] > 0 and fig["tokens_per_s"] > 0


def test_max_seconds_ends_the_window_with_the_figures_of_what_came_back(taskset):
    """A run asked for far more batches than fit in --max-seconds still reports, over the window it had."""
    tasks_dir, _, _ = taskset
    proc = bench("--tasks", str(tasks_dir), *TINY_RUN, "--steps", "1000", "--max-seconds", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fig["stopped_early"] is True and "--max-seconds 8" in proc.stderr
    assert fig["wall_s"] >= 8 and fig["accepted"] < 2000  # the window ran its 8 s, and ended before the 1000 batches
    assert fig["wall_s"] < 80  # a loose guard (10x the window): when the timer fires past 8 s is the machine's load
    marks = fig["batch_marks_s"]  # the figures are of the window: what came back in it, over its length
    assert fig["accepted"] == 2 * len(marks) and marks == sorted(marks) and all(m <= fig["wall_s"] for m in marks)
    assert fig["rollouts"] >= fig["accepted"] and sum(fig["statuses"].values()) == fig["rollouts"]
    assert fig["rollouts_per_hour"] == pytest.approx(fig["rollouts"] / fig["wall_s"] * 3600, rel=0.02)
    assert fig["accepted_per_hour"] == pytest.approx(fig["accepted"] / fig["wall_s"] * 3600, rel=0.02)
