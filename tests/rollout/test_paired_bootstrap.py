"""The bootstrap intervals of `shipyard.rollout.eval` (what `shipyard bench learning` reports) on cases computed by
hand: identical arms, a constant shift, two tasks whose resampled means take three values, a task one arm did not
score, and seeded determinism."""

from __future__ import annotations

import pytest

from shipyard.errors import UsageError
from shipyard.rollout.eval import bootstrap_mean, paired_difference, task_rates


def test_identical_arms_differ_by_exactly_zero():
    a = {"t1": 0.0, "t2": 0.5, "t3": 1.0, "t4": 0.5}
    assert paired_difference(a, dict(a)) == {"mean": 0.0, "ci95": [0.0, 0.0], "tasks": 4}


def test_a_constant_shift_is_its_own_interval():
    a = {"t1": 0.0, "t2": 0.25, "t3": 0.5}
    b = {t: v + 0.25 for t, v in a.items()}
    assert paired_difference(a, b) == {"mean": 0.25, "ci95": [0.25, 0.25], "tasks": 3}
    assert paired_difference(b, a)["ci95"] == [-0.25, -0.25]


def test_pairing_removes_the_spread_both_arms_share():
    # tasks differ wildly in difficulty, the arms by 0.5 everywhere: unpaired intervals are wide, the paired one is not
    a = {"easy": 0.5, "hard": 0.0, "mid": 0.25, "none": 0.0}
    b = {"easy": 1.0, "hard": 0.5, "mid": 0.75, "none": 0.5}
    assert bootstrap_mean(list(b.values()))["ci95"][1] - bootstrap_mean(list(b.values()))["ci95"][0] > 0.25
    assert paired_difference(a, b)["ci95"] == [0.5, 0.5]


def test_two_tasks_give_the_three_point_distribution():
    # differences 0 and 1: a resampled mean is 0 (p 1/4), 0.5 (p 1/2) or 1 (p 1/4), so the 2.5 % and 97.5 %
    # quantiles of 2000 draws are 0 and 1 (fewer than 50 zeros in 2000 draws at p = 1/4: probability < 1e-100)
    out = paired_difference({"a": 0.0, "b": 0.0}, {"a": 0.0, "b": 1.0})
    assert out == {"mean": 0.5, "ci95": [0.0, 1.0], "tasks": 2}
    # one resample is its own interval; one task too
    assert bootstrap_mean([0.0, 1.0], resamples=1, seed=3)["ci95"][0] == bootstrap_mean([0.0, 1.0], resamples=1,
                                                                                       seed=3)["ci95"][1]
    assert bootstrap_mean([0.75]) == {"mean": 0.75, "ci95": [0.75, 0.75], "tasks": 1}


def test_only_tasks_both_arms_scored_are_paired():
    a = {"t1": 0.0, "t2": None, "t3": 0.5, "only_a": 1.0}
    b = {"t1": 0.5, "t2": 1.0, "t3": 1.0, "only_b": 0.0}
    assert paired_difference(a, b) == {"mean": 0.5, "ci95": [0.5, 0.5], "tasks": 2}
    assert paired_difference({}, b) == {"mean": None, "ci95": None, "tasks": 0}


def test_intervals_are_seeded_and_well_formed():
    values = [0.0, 0.5, 1.0, 0.0, 0.5, 0.0, 1.0, 0.5]
    first = bootstrap_mean(values, seed=7)
    assert first == bootstrap_mean(values, seed=7)
    lo, hi = first["ci95"]
    assert 0.0 <= lo < first["mean"] < hi <= 1.0
    others = {tuple(bootstrap_mean(values, seed=s, resamples=50)["ci95"]) for s in range(20)}
    assert len(others) > 1  # the seed is what makes it repeatable, not a degenerate draw
    # task order does not matter: pairs are taken in sorted task order
    a = {f"t{i}": v for i, v in enumerate(values)}
    b = {f"t{i}": 1.0 - v for i, v in enumerate(values)}
    assert paired_difference(a, b, seed=1) == paired_difference(dict(reversed(a.items())), b, seed=1)
    with pytest.raises(UsageError, match="at least 1 resample"):
        bootstrap_mean(values, resamples=0)


def test_task_rates_reads_a_results_document():
    doc = {"tasks": {"x": {"pass_at": {"1": 0.5, "2": 1.0}}, "y": {"pass_at": {"1": None}}}}
    assert task_rates(doc) == {"x": 0.5, "y": None}
    assert task_rates(doc, 2) == {"x": 1.0, "y": None}
