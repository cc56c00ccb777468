"""The curriculum: p(1-p) sampling within the band, EMA pass rates, tier escalation, retirement, checkpoints."""

import json
import random
from collections import Counter

import pytest

from shipyard.tasks.curriculum import Curriculum, CurriculumConfig, Difficulty


def make(n_per_tier=4, tiers=(1, 2, 3), **config):
    tasks = {f"t{tier}-{i}": Difficulty(tier, 5 * tier, tier, 1 + i) for tier in tiers for i in range(n_per_tier)}
    return Curriculum(tasks, CurriculumConfig(**config))


def test_only_the_lowest_tier_is_open_at_first_and_unseen_tasks_weigh_most():
    c = make()
    assert c.open_tier == 1 and set(c.pool()) == {f"t1-{i}" for i in range(4)}
    c.record("t1-0", [1, 0, 0, 0])  # p = 0.25 → weight 0.1875 vs 0.25 for the unseen
    w = c.weights()
    assert w["t1-1"] > w["t1-0"] and sum(w.values()) == pytest.approx(1.0)
    assert w["t1-0"] / w["t1-1"] == pytest.approx(0.25 * 0.75 / 0.25)


def test_ema_and_band():
    c = make(ema_decay=0.5)
    c.record("t1-0", [1, 1, 1, 1])
    c.record("t1-0", [0, 0, 0, 0])
    assert c.tasks["t1-0"].ema == pytest.approx(0.5) and c.tasks["t1-0"].attempts == 8
    c.record("t1-1", [0, 0, 0, 0])  # p = 0: outside the band, never sampled while others are inside
    assert "t1-1" not in c.weights()
    draws = Counter(c.sample(2000, random.Random(0)))
    assert "t1-1" not in draws and set(draws) == {"t1-0", "t1-2", "t1-3"}
    for t in ("t1-0", "t1-2", "t1-3"):
        for _ in range(3):  # EMA 0.5 → 0.0625: below the band
            c.record(t, [0] * 4)
    assert set(c.weights()) == set(c.pool())  # nothing inside the band: fall back to the whole open pool


def test_escalation_when_over_half_the_pool_passes():
    c = make(ema_decay=0.0)
    c.record("t1-0", [1] * 4)
    c.record("t1-1", [1] * 4)
    assert c.open_tier == 1  # exactly half: not over half
    c.record("t1-2", [1] * 4)
    assert c.open_tier == 2 and any(t.startswith("t2") for t in c.pool())


def test_retirement_and_the_end_of_the_task_set():
    c = make(n_per_tier=1, tiers=(1,), ema_decay=0.0, retire_min_attempts=8)
    c.record("t1-0", [1] * 4)
    assert not c.tasks["t1-0"].retired  # too few attempts yet
    c.record("t1-0", [1] * 4)
    assert c.tasks["t1-0"].retired and c.pool() == []
    with pytest.raises(RuntimeError, match="every task is retired"):
        c.sample(1)


def test_state_round_trips_through_json():
    c = make()
    c.record("t1-0", [1, 0])
    again = make()
    again.load_state(json.loads(json.dumps(c.state())))
    assert again.state() == c.state()
    with pytest.raises(KeyError, match="unknown task"):
        c.record("nope", [1])
    with pytest.raises(ValueError, match="at least one task"):
        Curriculum({})
