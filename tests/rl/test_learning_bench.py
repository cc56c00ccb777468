"""`shipyard bench learning` end to end with the tiny random model (one step per arm: the pipeline, not the
figures), and its arithmetic on made-up curves."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from tiny_run import CONFIG

from shipyard.bench import learning
from shipyard.sandbox.run import sandbox_problem

TINY = CONFIG + "\n[trainer.distill]\nmin_lift = -1e9  # every hint kept: the random model's lift has either sign\n"


def test_steps_ratio_and_its_refusals():
    assert learning.steps_ratio([0.1, 0.2, 0.4, 0.5], [0.1, 0.5, 0.6, 0.7]) == (
        0.5, "reached 0.500 at step 2; the reward-only arm made 4")
    ratio, why = learning.steps_ratio([0.0, 0.0, 0.0], [0.0, 0.3, 0.5])
    assert ratio is None and "did not raise the rate" in why  # nothing to reach: not a win for the other arm
    ratio, why = learning.steps_ratio([0.1, 0.4], [0.1, 0.2])
    assert ratio is None and "never reached" in why
    assert learning.smooth([0.0, 1.0, 0.5, 0.5], 2) == [0.0, 0.5, 0.75, 0.5]


def test_pass_change_bootstraps_over_tasks():
    def doc(passes):
        return {"tasks": {t: {"pass_at": {"1": p}} for t, p in passes.items()},
                "overall": {"pass_at": {"1": sum(passes.values()) / len(passes)}}}

    change = learning.pass_change({0: doc({"a": 0.0, "b": 0.0, "c": 0.5}), 5: doc({"a": 1.0, "b": 0.5, "c": 0.5})},
                                  resamples=500)
    assert change["change"] == pytest.approx(0.5) and change["tasks"] == 3
    lo, hi = change["ci95"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0
    assert learning.pass_change({0: doc({"a": 0.0})}, resamples=10)["change"] is None


@pytest.mark.skipif(sandbox_problem() is not None, reason="this host cannot start bubblewrap sandboxes")
def test_the_bench_trains_both_arms_and_reports_them(taskset, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(tasks=taskset[0]))
    proc = subprocess.run([sys.executable, "-m", "shipyard.bench.learning", "--config", str(config), "--steps", "1",
                           "--eval-every", "1", "--minutes", "8", "--tasks", str(taskset[0]), "--out",
                           str(tmp_path / "out"), "--bootstrap", "50"], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["arms"]) == {"reward", "feedback"}
    for arm in result["arms"].values():
        assert arm["steps"] == 1 and arm["status"] == "finished" and arm["pass_at_1"]["steps"] == [0, 1]
    assert result["arms"]["feedback"]["hints"] >= 1 and result["arms"]["reward"]["hints"] == 0
    assert Path(result["plot"]).stat().st_size > 10_000
    saved = {arm: tomllib.loads((tmp_path / "out" / arm / "config.toml").read_text()) for arm in ("reward", "feedback")}
    assert saved["feedback"]["hints"]["enabled"] and not saved["reward"]["hints"]["enabled"]
    assert saved["feedback"]["run"]["seed"] == saved["reward"]["run"]["seed"]
