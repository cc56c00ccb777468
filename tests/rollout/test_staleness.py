"""Bounded staleness under a fake trainer that bumps versions: the invariant, synchronous RL, drops and masks."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schedfakes import Outcome, ScriptedTransport, turn, wait_until

from shipyard.harness.trajectory import Trajectory
from shipyard.rollout.record import Rollout
from shipyard.rollout.scheduler import Scheduler, SchedulerConfig
from shipyard.rollout.staleness import StalenessGate
from shipyard.tasks.curriculum import Curriculum, Difficulty
from shipyard.train.batch import Batch

TASKS = Path("/nonexistent-tasks")


def make(script, *, capacity=4, tasks=("a", "b", "c"), **config):
    transport = ScriptedTransport(script, capacity=capacity)
    cfg = SchedulerConfig(**{"group_size": 2, "groups_per_step": 2, **config})
    cur = Curriculum({t: Difficulty(1, 1, 1, 1) for t in tasks})
    return Scheduler(cfg, transport, TASKS, cur), transport


async def train(sched: Scheduler, steps: int, train_seconds: float):
    """A fake trainer: take a batch, check it, 'train', push the next version."""
    out = []
    for v in range(steps):
        batch = await sched.next_batch()
        assert batch.trainer_version == v
        out.append(batch)
        await asyncio.sleep(train_seconds)
        await sched.update_weights(v + 1, {})
    await sched.close()
    return out


def test_gate_quota():
    gate = StalenessGate(max_staleness=1, groups_per_step=3)
    assert gate.quota() == 6
    for _ in range(6):
        assert gate.may_start()
        gate.started()
    assert not gate.may_start()
    gate.released()
    assert gate.may_start()
    gate.started()
    gate.advance(1)
    assert gate.quota() == 9 and gate.may_start()
    with pytest.raises(ValueError, match="must grow"):
        gate.advance(1)
    with pytest.raises(ValueError, match="^max_staleness must be >= 0, got -1$"):
        StalenessGate(max_staleness=-1, groups_per_step=1)
    with pytest.raises(ValueError, match="stale_tokens must be one of"):
        StalenessGate(max_staleness=1, groups_per_step=1, stale_tokens="keep")
    with pytest.raises(ValueError, match="stale_tokens must be one of"):
        SchedulerConfig(stale_tokens="ignore")


def trained_versions(batch) -> list[int]:
    """The policy versions of the tokens a batch trains on (loss mask 1, in a rollout with a reward)."""
    b = Batch.from_rollouts(batch, pad_id=0)
    return b.versions[(b.loss_mask * b.sample_mask[:, None]) > 0].tolist()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(eta=st.integers(0, 3), seed=st.integers(0, 2**16), capacity=st.integers(1, 6),
       train_ms=st.sampled_from([0, 2, 10]), stale_tokens=st.sampled_from(["drop", "mask"]))
def test_no_trained_token_is_older_than_the_bound(eta, seed, capacity, train_ms, stale_tokens):
    """Under either policy no batch trains on a token sampled more than η versions before it; under "drop" no
    accepted rollout even holds one."""
    rng = random.Random(seed)
    durations = {}

    def script(spec):
        # heavy-tailed turn times: most rollouts are quick, a few are stragglers spanning several updates
        d = durations.setdefault(spec.rollout_id, min(0.05, rng.paretovariate(1.2) * 0.001))
        return Outcome(reward=float(spec.index % 2), turns=rng.randint(1, 3), turn_seconds=d)

    sched, _ = make(script, capacity=capacity, max_staleness=eta, stale_tokens=stale_tokens)
    got = asyncio.run(asyncio.wait_for(train(sched, 6, train_ms / 1000), timeout=60))
    for batch in got:
        assert batch.min_version == batch.trainer_version - eta
        trained = trained_versions(batch)
        assert trained and min(trained) >= batch.trainer_version - eta
        if stale_tokens == "drop":
            assert max(batch.staleness()) <= eta
    stats = sched.stats()
    if stale_tokens == "drop":
        assert stats["max_observed_staleness"] <= eta and stats["masked_stale_tokens"] == 0
    assert sum(stats["staleness_histogram"].values()) == 6 * 2 * 2


def test_max_staleness_zero_is_the_synchronous_algorithm():
    rng = random.Random(3)
    sched, transport = make(lambda s: Outcome(reward=float(s.index % 2), turn_seconds=rng.random() * 0.01),
                            capacity=3, max_staleness=0)
    got = asyncio.run(asyncio.wait_for(train(sched, 4, 0.02), timeout=30))
    # every rollout of batch k started at version k, and exactly batch k's rollouts did
    for k, batch in enumerate(got):
        started = [(spec.rollout_id, v) for spec, v in transport.starts if v == k]
        assert sorted(rid for rid, _ in started) == sorted(r.rollout_id for r in batch.rollouts)
        assert all(v == k for r in batch.rollouts for v in r.versions)
    assert len(transport.starts) == 4 * 2 * 2  # nothing ran ahead
    assert sched.stats()["max_observed_staleness"] == 0


def test_async_generation_overlaps_training():
    sched, transport = make(lambda s: Outcome(reward=float(s.index % 2), turn_seconds=0.005), max_staleness=2)

    async def go():
        await sched.next_batch()
        # while the trainer 'trains' on version 0's batch, the next (η = 2) batches' worth start at version 0 ...
        await wait_until(lambda: len(transport.starts) >= 3 * 2 * 2, timeout=20)
        await asyncio.sleep(0.1)  # ... and no more than that
        started = list(transport.starts)
        await sched.update_weights(1, {})
        await sched.close()
        return started

    started = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert len(started) == 3 * 2 * 2 and all(v == 0 for _, v in started)


def straggler_scheduler(turns: int, turn_seconds: float, stale_tokens: str = "drop") -> Scheduler:
    """Groups of two with max_staleness 1, whose first group ("a@0") runs `turns` turns of `turn_seconds` while
    every other group takes one quick turn."""
    def script(spec):
        if spec.group_id == "a@0":
            return Outcome(reward=float(spec.index % 2), turns=turns, turn_seconds=turn_seconds)
        return Outcome(reward=float(spec.index % 2), turns=1, turn_seconds=0.002)

    return make(script, tasks=("a",), groups_per_step=1, max_staleness=1, stale_tokens=stale_tokens)[0]


@pytest.mark.parametrize("stale_tokens", ["drop", "mask"])
def test_a_straggler_past_the_bound_is_dropped_and_counted(stale_tokens):
    """One turn, all of it older than η by the time it ends: nothing to train on under either policy."""
    sched = straggler_scheduler(turns=1, turn_seconds=0.5, stale_tokens=stale_tokens)

    async def go():
        taken = []
        for v in range(200):
            batch = await sched.next_batch()
            taken += [g.group_id for g in batch.groups]
            await asyncio.sleep(0.01)
            await sched.update_weights(v + 1, {})
            if sched.stats()["dropped_stale_groups"]:
                break
        await sched.close()
        return taken

    taken = asyncio.run(asyncio.wait_for(go(), timeout=30))
    stats = sched.stats()
    assert stats["dropped_stale_groups"] == 1 and stats["dropped_stale_rollouts"] == 2
    assert "a@0" not in taken


@pytest.mark.parametrize("stale_tokens", ["drop", "mask"])
def test_engines_that_never_receive_the_weights_are_an_error_not_a_loop(stale_tokens):
    class Deaf(ScriptedTransport):
        async def update_weights(self, version, tensors):  # drops the weights on the floor
            pass

    transport = Deaf(lambda s: Outcome(reward=float(s.index % 2)), capacity=4)
    sched = Scheduler(SchedulerConfig(group_size=2, groups_per_step=2, max_staleness=0, stale_tokens=stale_tokens),
                      transport, TASKS,
                      Curriculum({"a": Difficulty(1, 1, 1, 1)}))

    async def go():
        try:
            await sched.next_batch()
            await sched.update_weights(1, {})
            with pytest.raises(RuntimeError, match="not receiving the weights"):
                await sched.next_batch()
        finally:
            await sched.close()

    asyncio.run(asyncio.wait_for(go(), timeout=30))
    # the first group of version 1 sampled at version 0 gives it away (before: 5 stale drops in a row)
    assert sched.stats()["dropped_stale_groups"] <= 2 * 1 * 2 + 1


def test_a_group_doomed_by_an_update_is_cancelled_early_and_dropped():
    """stale_tokens = "drop": a group that can no longer be accepted whole stops spending the engines."""
    sched = straggler_scheduler(turns=50, turn_seconds=0.02)  # 50 turns of 20 ms: would outlive several updates

    async def go():
        taken = []
        for v in range(3):
            batch = await sched.next_batch()
            taken += [g.group_id for g in batch.groups]
            await sched.update_weights(v + 1, {})
        await wait_until(lambda: sched.stats()["cancelled"] >= 2, timeout=20)  # they notice at their next turn
        stats = sched.stats()
        await sched.close()
        return taken, stats

    taken, stats = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert "a@0" not in taken
    # doomed at the update to version 2 (it began at 0, η = 1), cancelled long before its 50 turns (1 s)
    assert stats["doomed_groups"] == 1 and stats["cancelled"] == 2
    assert stats["dropped_stale_groups"] == 1 and stats["dropped_stale_rollouts"] == 2
    assert stats["dropped_zero_variance"] == 0  # a doomed group does not use up a refill


def test_a_masked_straggler_is_kept_and_learns_only_from_its_fresh_turns():
    """stale_tokens = "mask" (the default): the group that "drop" cancels runs to the end and is accepted; its turns
    sampled more than η versions before the batch are context (loss mask 0), its recent turns are trained on."""
    assert SchedulerConfig().stale_tokens == "mask"

    def attempt():
        # 80 turns of 3 ms against a trainer step of >= 30 ms: the group spans several updates, each turn within one
        sched = straggler_scheduler(turns=80, turn_seconds=0.003, stale_tokens="mask")

        async def go():
            for v in range(200):
                batch = await sched.next_batch()
                if "a@0" in [g.group_id for g in batch.groups] or sched.stats()["dropped_stale_groups"]:
                    break
                await asyncio.sleep(0.03)
                await sched.update_weights(v + 1, {})
            stats = sched.stats()
            await sched.close()
            return batch, stats

        return asyncio.run(asyncio.wait_for(go(), timeout=30))

    # A stall of the event loop longer than two trainer steps during the straggler's last turn leaves it nothing
    # fresh to train on, and dropping it is then right: a few attempts keep the test about the accepted case.
    for _ in range(3):
        batch, stats = attempt()
        if "a@0" in [g.group_id for g in batch.groups]:
            break
        assert stats["dropped_stale_groups"] == 1, stats  # not accepted: only because it was stale
    [straggler] = [g for g in batch.groups if g.group_id == "a@0"]
    versions = straggler.rollouts[0].versions
    assert len(versions) == 80 and versions[0] < batch.min_version <= versions[-1]  # it spans the bound
    b = Batch.from_rollouts(batch, pad_id=0)
    row = [r.rollout_id for r in batch.rollouts].index(straggler.rollouts[0].rollout_id)
    sampled, trained = b.versions[row][b.versions[row] != 0], b.versions[row][b.loss_mask[row] > 0]
    assert len(trained) and set(trained.tolist()) == {v for v in sampled.tolist() if v >= batch.min_version}
    assert stats["doomed_groups"] == 0 and stats["cancelled"] == 0 and stats["dropped_stale_groups"] == 0
    assert stats["masked_stale_tokens"] > 0 and 0 < stats["trained_token_fraction"] < 1


@pytest.mark.parametrize("stale_tokens", ["drop", "mask"])
def test_one_engine_that_misses_the_weights_is_an_error_under_either_policy(stale_tokens):
    """Review: under "mask" a single deaf engine (sticky routing sends rollout 0 of every group there) trained on
    silently, half its tokens masked. A turn sampled by a version older than its group's start is impossible when
    the weights arrive (they reach every engine before the gate advances): the scheduler says so."""
    class HalfDeaf(ScriptedTransport):
        async def run(self, spec, cancelled):
            rollout = await super().run(spec, cancelled)
            if spec.index == 0:
                for t in rollout.trajectory.turns:
                    t.policy_version = 0
            return rollout

    transport = HalfDeaf(lambda s: Outcome(reward=float(s.index % 2)), capacity=4)
    sched = Scheduler(SchedulerConfig(group_size=2, groups_per_step=2, max_staleness=1, stale_tokens=stale_tokens),
                      transport, TASKS, Curriculum({"a": Difficulty(1, 1, 1, 1)}))

    async def go():
        try:
            for v in range(20):
                await sched.next_batch()
                await sched.update_weights(v + 1, {})
        finally:
            await sched.close()

    with pytest.raises(RuntimeError, match="not receiving the weights"):
        asyncio.run(asyncio.wait_for(go(), timeout=60))


def rollout_with(index: int, versions: list[int], reward: float | None, tokens: int = 3) -> Rollout:
    traj = Trajectory(task="a", model="m", prompt_ids=[1])
    traj.turns = [turn(i, v, tokens) for i, v in enumerate(versions)]
    return Rollout("a", "a@0", index, index, "graded" if reward is not None else "cancelled", reward,
                   trajectory=traj)


def test_mask_acceptance_counts_only_tokens_that_would_train():
    """Review: a group whose only fresh turn belongs to a rollout without a reward (a cancelled straggler), or has
    no tokens, has nothing to train on: it is not fresh. Statistics count rewarded rollouts only."""
    gate = StalenessGate(max_staleness=1, groups_per_step=1, stale_tokens="mask")
    for v in range(1, 5):
        gate.advance(v)  # trainer at 4: tokens of versions < 3 are stale
    stale_pair = [rollout_with(0, [1, 2], 1.0), rollout_with(1, [1], 0.0)]
    assert not gate.fresh([*stale_pair, rollout_with(2, [1, 3], None)], 0)  # the fresh turn has no reward
    assert not gate.fresh([*stale_pair, rollout_with(2, [3], 1.0, tokens=0)], 0)  # a fresh turn of no tokens
    group = [*stale_pair, rollout_with(2, [2, 3], 0.0)]
    assert gate.fresh(group, 0) and gate.trainable_tokens(group) == 3
    gate.accept([*group, rollout_with(3, [4, 4], None)], 0)  # the unrewarded rollout trains nothing: not counted
    stats = gate.stats()
    assert (stats["sampled_tokens"], stats["masked_stale_tokens"], stats["fully_masked_rollouts"]) == (15, 12, 2)
    assert stats["trained_token_fraction"] == pytest.approx(3 / 15)


def test_a_group_that_sampled_nothing_is_judged_by_its_start():
    """CI: a group whose rollouts all failed (or stopped before a turn) has no token to be stale; under "mask" it was
    dropped as stale, which tripped the deaf-engine guard instead of saying that every rollout failed."""
    gate = StalenessGate(max_staleness=1, groups_per_step=1, stale_tokens="mask")
    failed = [rollout_with(0, [], None), rollout_with(1, [], 0.0)]
    assert gate.fresh(failed, 0)
    gate.advance(1)
    gate.advance(2)
    assert not gate.fresh(failed, 0) and gate.fresh(failed, 1)
