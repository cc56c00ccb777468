"""The [shaping] section builds the loop's shaping terms; a flagged rollout ends at 0 whatever else it earned; the
batch and eval figures report grounded tool-call validity."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from shipyard.harness.trajectory import CallRecord, Trajectory, Turn
from shipyard.rl.build import group_shaping_terms, shaping_terms
from shipyard.rl.config import ConfigError, RLConfig, ShapingConfig, load_config
from shipyard.rl.loop import batch_metrics
from shipyard.rollout.advantages import (
    EffortCalibration,
    GroundedCalls,
    HackPenalty,
    ParallelBonus,
    group_advantages,
    shaped_reward,
)
from shipyard.rollout.batches import RolloutBatch, RolloutGroup
from shipyard.rollout.eval import results
from shipyard.rollout.record import Rollout
from shipyard.tasks.monitors import Flag

GOOD = CallRecord(0, "run_terminal", {"command": "python -m pytest -q"}, "1 passed\n[exit code 0]", None, 0.1)
COPIED = CallRecord(1, "run_terminal", {"command": "the bash command line to run"}, "not found", None, 0.1)
NEGATIVE = r"c\.toml: \[shaping\] shaping coefficients \(and effort_tier_scale\) must be finite and >= 0 \("


def rollout(reward, calls, *, flagged=False, index=0):
    traj = Trajectory(task="t", model="m", prompt_ids=[1, 2])
    traj.turns.append(Turn(index=0, text="x", completion_ids=[7, 7], logprobs=[-0.5, -0.5], finish_reason="stop",
                           observation_ids=[9], calls=list(calls), parallel_width=len(calls), generate_seconds=0.0,
                           tools_seconds=0.0, policy_version=0))
    r = Rollout("t", "g", index, index, "graded", reward, trajectory=traj)
    if flagged:
        r.monitor_flags = [asdict(Flag("test_edit", 0, 0, "search_replace tests/test_x.py"))]  # as run_episode keeps it
    return r


def test_shaping_section_builds_the_terms_in_order(tmp_path):
    assert shaping_terms(RLConfig()) == ()  # nothing on by default
    config = RLConfig(shaping=ShapingConfig(grounded=0.2, placeholder=0.3, parallel=0.05))
    config.run.zero_flagged = True
    terms = shaping_terms(config)
    assert [type(t) for t in terms] == [GroundedCalls, ParallelBonus, HackPenalty]  # the penalty last
    assert (terms[0].coef, terms[0].placeholder_coef, terms[1].coef) == (0.2, 0.3, 0.05)
    path = tmp_path / "c.toml"
    path.write_text("[shaping]\ngrounded = 0.1\n")
    assert load_config(path, ["--shaping.placeholder", "0.4"]).shaping == ShapingConfig(grounded=0.1, placeholder=0.4)
    for bad in ("-0.1", "nan", "inf"):
        path.write_text(f"[shaping]\ngrounded = {bad}\n")
        with pytest.raises(ConfigError, match=NEGATIVE):
            load_config(path)
    assert group_shaping_terms(RLConfig()) == ()
    path.write_text("[shaping]\neffort = 0.1\neffort_tier_scale = [1.0, 0.3]\n")
    [effort] = group_shaping_terms(load_config(path))
    assert effort == EffortCalibration(0.1, 256, (1.0, 0.3))
    path.write_text("[shaping]\neffort = 0.1\neffort_tier_scale = [1.0, -0.3]\n")
    with pytest.raises(ConfigError, match=NEGATIVE):
        load_config(path)


def test_a_flagged_rollout_ends_at_the_floor_even_with_a_shaping_bonus():
    terms = [GroundedCalls(0.5, 0.0, target=1), HackPenalty()]
    flagged = rollout(1.0, [GOOD], flagged=True)
    assert shaped_reward(flagged, terms) == pytest.approx(0.0)
    assert flagged.shaping["grounded"] == pytest.approx(0.5) and flagged.reward == 1.0  # the grader's, kept
    clean = rollout(1.0, [GOOD])
    assert shaped_reward(clean, terms) == pytest.approx(1.5) and clean.shaping["hack"] == 0.0


def test_a_flagged_rollout_never_gets_a_positive_advantage():
    """Review finding: at a floor of 0, peers charged the placeholder penalty ranked a flagged hack above them."""
    config = RLConfig(shaping=ShapingConfig(grounded=0.5, placeholder=0.5))
    config.run.zero_flagged = True
    terms = shaping_terms(config)
    group = [rollout(1.0, [GOOD], flagged=True, index=0), rollout(0.0, [COPIED], index=1),
             rollout(0.0, [COPIED], index=2), rollout(0.0, [], index=3)]
    totals = [shaped_reward(r, terms) for r in group]
    advantages = group_advantages(totals)
    assert totals[0] == min(totals) and advantages[0] <= 0.0


def test_batch_and_eval_report_grounded_validity():
    rollouts = [rollout(0.0, [GOOD, COPIED], index=0), rollout(1.0, [GOOD], index=1)]
    batch = RolloutBatch([RolloutGroup("t", "g", rollouts)])
    tools = batch_metrics(batch)["tools"]
    assert (tools["calls"], tools["grounded"], tools["placeholder"]) == (3, 2, 1)
    assert tools["grounded_fraction"] == pytest.approx(2 / 3)
    doc = results({"t": rollouts}, [1], config={}, wall_seconds=1.0)
    overall = doc["overall"]
    assert overall["validity"]["grounded_fraction"] == pytest.approx(2 / 3)
    assert overall["reward_mean"] == pytest.approx(0.5)


def test_batch_metrics_count_flags_by_their_kind():
    """A flag as `run_episode` stores it (`monitors.Flag` as a dict) is counted under its kind (was `flag_unknown`)."""
    batch = RolloutBatch([RolloutGroup("t", "g", [rollout(1.0, [], flagged=True), rollout(0.0, [], index=1)])])
    metrics = batch_metrics(batch)["monitor"]
    assert metrics == {"flagged": 1, "flag_test_edit": 1}


def test_batch_metrics_report_each_shaping_term_and_whether_it_acted():
    """Effort calibration pays only among a group's solutions: with one solution it is 0 everywhere, and the metrics
    say so (`_active` 0) instead of leaving an effort arm indistinguishable from none."""
    terms = [GroundedCalls(0.5, 0.0, target=1)]
    group = [rollout(1.0, [GOOD], index=0), rollout(0.0, [COPIED], index=1), rollout(0.0, [], index=2)]
    effort = EffortCalibration(0.1)
    for r, value in zip(group, effort.group(group, tier=1), strict=True):
        r.shaping[effort.name] = value
    for r in group:
        shaped_reward(r, terms)
    shaping = batch_metrics(RolloutBatch([RolloutGroup("t", "g", group)]))["shaping"]
    assert shaping["effort_calibration_active"] == 0 and shaping["effort_calibration_mean"] == 0.0
    assert shaping["grounded_active"] == 1 and shaping["grounded_mean"] == pytest.approx(0.5 / 3)
