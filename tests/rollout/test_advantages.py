"""Group-relative advantages against hand-computed formulas; masked rollouts; shaping terms."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from schedfakes import turn

from shipyard.harness.trajectory import CallRecord, Trajectory, Turn
from shipyard.rollout.advantages import (
    EffortCalibration,
    EffortPenalty,
    GroundedCalls,
    ParallelBonus,
    group_advantages,
    no_signal,
    shaped_reward,
    shaped_rewards,
)
from shipyard.rollout.record import Rollout


def test_mean_baseline_by_hand():
    # rewards 1, 0, 0, 1 -> mean 0.5
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]


def test_std_normalised_by_hand():
    # rewards 1, 0, 0, 0: mean 0.25, population std sqrt(0.75*0.25) = 0.4330127
    std = math.sqrt(((0.75) ** 2 + 3 * 0.25 ** 2) / 4)
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], std_normalize=True, eps=0.0)
    assert adv == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])


def test_leave_one_out_by_hand():
    rewards = [1.0, 0.0, 0.5]
    expected = [1.0 - (0.0 + 0.5) / 2, 0.0 - (1.0 + 0.5) / 2, 0.5 - (1.0 + 0.0) / 2]
    assert group_advantages(rewards, leave_one_out=True) == pytest.approx(expected)


def test_masked_rollouts_are_excluded_and_get_zero():
    # the None is neither a zero reward nor a baseline member: stats over [1, 0] only
    assert group_advantages([1.0, None, 0.0]) == [0.5, 0.0, -0.5]
    assert group_advantages([1.0, None, 0.0], leave_one_out=True) == [1.0, 0.0, -1.0]
    # a zero in place of the None would have changed the baseline
    assert group_advantages([1.0, 0.0, 0.0]) != [0.5, 0.0, -0.5]


def test_groups_without_a_baseline_get_zero():
    assert group_advantages([1.0]) == [0.0]
    assert group_advantages([None, 1.0, None]) == [0.0, 0.0, 0.0]
    assert group_advantages([None, None]) == [0.0, 0.0]


@given(st.lists(st.one_of(st.none(), st.floats(-10, 10)), min_size=1, max_size=12), st.booleans(), st.booleans())
def test_advantages_sum_to_zero_over_rewarded_rollouts(rewards, std, loo):
    adv = group_advantages(rewards, std_normalize=std, leave_one_out=loo)
    assert len(adv) == len(rewards)
    assert all(a == 0.0 for a, r in zip(adv, rewards, strict=True) if r is None)
    assert abs(sum(adv)) < 1e-6 * max(1.0, max(abs(a) for a in adv)) * len(adv)


def test_no_signal():
    assert no_signal([1.0, 1.0, 1.0])
    assert no_signal([0.0, None, 0.0])
    assert no_signal([1.0, None, None])
    assert no_signal([None, None])
    assert not no_signal([1.0, 0.0, None])


def rollout(reward, tokens=10, widths=(1,)):
    traj = Trajectory(task="t", model="m", prompt_ids=[1])
    for i, w in enumerate(widths):
        t = turn(i, 0, tokens)
        t.parallel_width = w
        traj.turns.append(t)
    return Rollout("t", "t@0", 0, 1, "graded" if reward is not None else "infra_error", reward, trajectory=traj)


def test_effort_penalty_is_soft_and_bounded():
    pen = EffortPenalty(free=100, limit=300, coef=0.2)
    assert pen(rollout(1.0, tokens=50, widths=(1, 1))) == 0.0  # 100 tokens: free
    assert pen(rollout(1.0, tokens=100, widths=(1, 1))) == pytest.approx(-0.1)  # 200: halfway
    assert pen(rollout(1.0, tokens=1000)) == pytest.approx(-0.2)  # capped
    with pytest.raises(ValueError, match="^EffortPenalty needs 0 <= free < limit, got free=10, limit=10$"):
        EffortPenalty(free=10, limit=10)


def test_parallel_bonus_only_on_solved():
    bonus = ParallelBonus(coef=0.3, cap=4)
    assert bonus(rollout(1.0, widths=(4, 2))) == pytest.approx(0.3 * (3 - 1) / 3)
    assert bonus(rollout(0.0, widths=(4, 4))) == 0.0
    assert bonus(rollout(1.0, widths=(1, 1))) == 0.0


def test_shaped_reward_records_terms_and_keeps_the_grader_reward():
    r = rollout(1.0, tokens=200, widths=(4,))
    total = shaped_reward(r, [EffortPenalty(free=100, limit=300, coef=0.2), ParallelBonus(coef=0.3, cap=4)])
    assert r.shaping == pytest.approx({"effort": -0.1, "parallel": 0.3})
    assert total == pytest.approx(1.2)
    assert r.reward == 1.0
    masked = rollout(None)
    assert shaped_reward(masked, [EffortPenalty()]) is None and masked.shaping == {}



class _Constant:
    name = "broken"

    def __init__(self, value):
        self.value = value

    def __call__(self, rollout):
        return self.value


def test_a_non_finite_shaping_term_is_refused_by_name():
    """Review: a shaping term that returns NaN (or inf) made the whole group's advantages NaN, silently poisoning
    the batch's loss (`no_signal` is False for NaN, so the group was even kept). It fails loudly, naming the term."""
    for bad in (math.nan, math.inf, -math.inf):
        r = Rollout("t", "g", 0, 1, "graded", 1.0, trajectory=Trajectory(task="x", model="m", prompt_ids=[]))
        with pytest.raises(ValueError, match="broken"):
            shaped_reward(r, [_Constant(bad)])


def rollout_with_calls(reward, calls):
    r = rollout(reward, widths=(len(calls),))
    r.trajectory.turns[0].calls = calls
    return r


GOOD = CallRecord(0, "run_terminal", {"command": "python -m pytest -q"}, "1 passed\n[exit code 0]", None, 0.1)
COPIED = CallRecord(1, "run_terminal", {"command": "the bash command line to run"}, "not found", None, 0.1)
FAILED = CallRecord(2, "read_file", {"path": "nope.py"}, "error: missing", "missing", 0.0, error_kind="tool_error")
COPIED_FAILED = CallRecord(3, "read_file", {"path": "File path relative to the workspace root."}, "error: x", "x",
                           0.0, error_kind="tool_error")


READ = CallRecord(4, "read_file", {"path": "pocketlib/stats.py"}, "1\tdef mean(", None, 0.1)
LS = CallRecord(5, "list_dir", {"path": "."}, "pocketlib/\ntests/", None, 0.1)


def test_grounded_calls_shaping_by_hand():
    term = GroundedCalls(coef=0.3, placeholder_coef=0.5, target=3)
    # 1 grounded (GOOD), 2 with a placeholder (COPIED ran, COPIED_FAILED failed), 1 plain failure
    r = rollout_with_calls(0.0, [GOOD, COPIED, FAILED, COPIED_FAILED])
    assert term(r) == pytest.approx(0.3 * 1 / 3 - 0.5)  # one copied placeholder costs the whole penalty
    assert term(rollout_with_calls(0.0, [GOOD, READ, LS])) == pytest.approx(0.3)  # the maximum: coef
    assert term(rollout_with_calls(0.0, [GOOD, READ, LS, GOOD, READ])) == pytest.approx(0.3)  # capped at target
    assert term(rollout_with_calls(1.0, [COPIED])) == pytest.approx(-0.5)  # the minimum, paid whatever the verdict
    assert term(rollout_with_calls(0.0, [FAILED])) == 0.0  # a failed call costs nothing but its turn
    assert term(rollout_with_calls(0.0, [])) == 0.0  # no calls: nothing to grade
    # repeating one grounded call earns no more than making it once
    assert term(rollout_with_calls(0.0, [GOOD] * 9)) == term(rollout_with_calls(0.0, [GOOD]))
    # cheap calls do not dilute a copied placeholder away (a first version paid +0.40 for this)
    assert term(rollout_with_calls(0.0, [COPIED, *[LS] * 9])) < term(rollout_with_calls(0.0, [LS]))
    # one call and stop earns no more than a real attempt
    assert term(rollout_with_calls(0.0, [LS])) <= term(rollout_with_calls(0.0, [GOOD, FAILED]))
    with pytest.raises(ValueError, match="target"):
        GroundedCalls(target=0)
    with pytest.raises(ValueError, match="finite"):
        GroundedCalls(coef=math.nan)


def test_grounded_calls_in_shaped_reward_and_off_by_default():
    r = rollout_with_calls(1.0, [GOOD, COPIED])
    total = shaped_reward(r, [GroundedCalls(coef=0.3, placeholder_coef=0.1, target=3)])
    assert r.shaping == pytest.approx({"grounded": 0.3 / 3 - 0.1}) and total == pytest.approx(1.0)
    r = rollout_with_calls(1.0, [GOOD, COPIED])
    assert shaped_reward(r, []) == 1.0 and r.shaping == {}  # a term is on only when listed
    masked = rollout_with_calls(None, [GOOD])
    assert shaped_reward(masked, [GroundedCalls()]) is None and masked.shaping == {}
    with pytest.raises(ValueError, match="placeholder_coef"):
        GroundedCalls(placeholder_coef=-1)


def test_untagged_credit_pays_part_for_a_call_grounded_but_for_its_tags():
    untagged = CallRecord(0, "run_terminal", {"command": "python -m pytest"}, "1 passed\n[exit code 0]", None, 0.1,
                          untagged=True)
    r = rollout_with_calls(0.0, [GOOD, untagged])
    assert GroundedCalls(coef=0.4, placeholder_coef=0.0, target=2)(r) == pytest.approx(0.4 / 2)  # strict: tags
    assert GroundedCalls(coef=0.4, placeholder_coef=0.0, untagged_credit=0.5, target=2)(r) == pytest.approx(
        0.4 * 1.5 / 2)
    copied_untagged = CallRecord(1, "run_terminal", {"command": "the bash command line to run"}, "x", None, 0.1,
                                 untagged=True)
    r = rollout_with_calls(0.0, [copied_untagged])  # a copied placeholder earns no credit, untagged or not
    assert GroundedCalls(coef=0.4, placeholder_coef=0.2, untagged_credit=1.0)(r) == pytest.approx(-0.2)
    with pytest.raises(ValueError, match="untagged_credit"):
        GroundedCalls(untagged_credit=1.5)


def _effort_rollout(index, tokens, turns, reward):
    traj = Trajectory(task="t", model="m", prompt_ids=[1])
    per_turn = [tokens // turns + (1 if i < tokens % turns else 0) for i in range(turns)]
    traj.turns = [Turn(i, "x", [5] * n, [0.0] * n, "stop", [], [], 0, 0.0, 0.0) for i, n in enumerate(per_turn)]
    return Rollout("t", "g", index, seed=index, status="x", reward=reward, trajectory=traj)


def test_effort_calibration_is_kimis_length_reward_relative_to_the_group_and_scaled_by_tier():
    term = EffortCalibration(coef=0.2, turn_tokens=10, tier_scale=(1.0, 0.5))
    group = [_effort_rollout(0, 90, 1, 1.0),    # effort 100: the shortest solution → λ = +0.5
             _effort_rollout(1, 180, 2, 1.0),   # effort 200: the middle → 0
             _effort_rollout(2, 270, 3, 1.0),   # effort 300: the longest solution → −0.5
             _effort_rollout(3, 10, 1, 0.0),    # a failure, however short or long, gets nothing
             _effort_rollout(4, 5, 1, None)]    # masked: sets no bound, gets nothing
    assert term.group(group, tier=1) == pytest.approx([0.1, 0.0, -0.1, 0.0, 0.0])
    assert term.group(group, tier=2) == pytest.approx([0.05, 0.0, -0.05, 0.0, 0.0])
    assert term.group(group, tier=7) == term.group(group, tier=2)  # the last scale holds for higher tiers
    same = [_effort_rollout(i, 100, 1, 1.0) for i in range(3)]
    assert term.group(same, tier=1) == [0.0, 0.0, 0.0]
    # a group of failures is not taught to give up sooner: no signal from effort at all
    failures = [_effort_rollout(i, 20 * (i + 1), i + 1, 0.0) for i in range(4)]
    assert term.group(failures, tier=1) == [0.0] * 4
    assert no_signal(shaped_rewards(failures, [], [term], tier=1))
    rewards = shaped_rewards(group, [], [term], tier=1)
    assert rewards == pytest.approx([1.1, 1.0, 0.9, 0.0, None]) and group[0].shaping == {"effort_calibration": 0.1}
    assert group[4].shaping == {}
    with pytest.raises(ValueError, match="tier_scale"):
        EffortCalibration(tier_scale=())
