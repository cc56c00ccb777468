"""The scheduler over a scripted transport: seeds, dynamic sampling, retries, re-queues, budgets, eval, shutdown."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from schedfakes import Outcome, ScriptedTransport
from servers import needs_sandbox

from shipyard.models.errors import InfraError
from shipyard.rollout.record import rollout_seed
from shipyard.rollout.scheduler import Scheduler, SchedulerConfig
from shipyard.tasks.curriculum import Curriculum, Difficulty

TASKS = Path("/nonexistent-tasks")  # the scripted transport never reads the task set


def curriculum(*ids: str) -> Curriculum:
    return Curriculum({t: Difficulty(1, 1, 1, 1) for t in ids})


def mixed(spec) -> Outcome:
    """Half the group solves it: every group has signal."""
    return Outcome(reward=float(spec.index % 2))


def scheduler(script, *, tasks=("a", "b"), capacity=4, shaping=(), group_shaping=(),
              **config) -> tuple[Scheduler, ScriptedTransport]:
    transport = ScriptedTransport(script, capacity=capacity)
    cfg = SchedulerConfig(**{"group_size": 4, "groups_per_step": 2, "max_staleness": 0, **config})
    return Scheduler(cfg, transport, TASKS, curriculum(*tasks), shaping, group_shaping), transport


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def batches(sched: Scheduler, steps: int):
    out = []
    for v in range(steps):
        out.append(await sched.next_batch())
        await sched.update_weights(v + 1, {})
    await sched.close()
    return out


# Faults first ----------------------------------------------------------------------------------------------------
def test_a_transport_bug_reaches_the_caller_instead_of_hanging():
    def broken(spec):
        raise RuntimeError("bug in the episode runner")

    sched, _ = scheduler(broken)

    async def go():
        try:
            with pytest.raises(RuntimeError, match="bug in the episode runner"):
                await sched.next_batch()
        finally:
            await sched.close()

    run(go())


def test_a_batch_where_every_rollout_failed_says_why():
    sched, _ = scheduler(lambda s: Outcome(fault="infra"), max_infra_retries=1, max_refills=3)

    async def go():
        try:
            with pytest.raises(InfraError, match="EnvServerUnreachable"):
                await sched.next_batch()
        finally:
            await sched.close()

    run(go())
    stats = sched.stats()
    # dynamic sampling dropped 3 all-masked groups (no signal), then the bound kept the next ones: the loop ended
    assert stats["dropped_zero_variance"] == 3 and stats["kept_zero_variance"] == 2
    assert stats["masked_infra"] == 5 * 4 and stats["infra_retries"] == 5 * 4
    assert stats["infra_by_cause"] == {"EnvServerUnreachable": 5 * 4 * 2}


def test_infra_errors_are_retried_with_the_same_seed_then_masked():
    def script(spec):
        if spec.group_id.endswith("@0") and spec.index == 0 and spec.attempt < 2:
            return Outcome(fault="infra")  # recovers on the third attempt
        if spec.group_id.endswith("@0") and spec.index == 1:
            return Outcome(fault="infra")  # never recovers
        return mixed(spec)

    sched, transport = scheduler(script, tasks=("a",), max_infra_retries=2, groups_per_step=1, dynamic_sampling=False)
    [batch] = run(batches(sched, 1))
    first = {r.index: r for r in batch.groups[0].rollouts}
    assert first[0].attempt == 2 and first[0].reward == 0.0 and not first[0].masked
    assert first[1].attempt == 2 and first[1].masked and first[1].status == "infra_error"
    assert batch.masks == [1, 0, 1, 1]
    assert first[1].advantage == 0.0
    # rewards [0, —, 0, 1]: the masked one is outside the mean
    assert [first[i].advantage for i in (0, 2, 3)] == pytest.approx([-1 / 3, -1 / 3, 2 / 3])
    attempts = Counter((s.index, s.seed) for s in transport.runs if s.group_id == "a@0")
    assert attempts[(0, rollout_seed(0, "a", 0))] == 3 and attempts[(1, rollout_seed(0, "a", 1))] == 3
    stats = sched.stats()
    assert stats["infra_retries"] == 4 and stats["masked_infra"] == 1
    assert stats["infra_by_cause"] == {"EnvServerUnreachable": 5}


def test_a_lost_worker_is_requeued_and_nothing_is_lost():
    lost = Counter()

    def script(spec):
        if spec.index == 2 and lost[spec.rollout_id] < 2:
            lost[spec.rollout_id] += 1
            return Outcome(fault="lost")
        return mixed(spec)

    sched, transport = scheduler(script, tasks=("a",), groups_per_step=1)
    [batch] = run(batches(sched, 1))
    rollouts = batch.groups[0].rollouts
    assert [r.index for r in rollouts] == [0, 1, 2, 3] and batch.masks == [1, 1, 1, 1]
    assert rollouts[2].attempt == 0  # a re-queue is the same spec, not a retry
    runs = [s for s in transport.runs if s.rollout_id == "a@0/2"]
    assert len(runs) == 3 and len({s.seed for s in runs}) == 1
    assert sched.stats()["requeued"] == 2


def test_a_worker_that_always_dies_is_masked_after_the_requeue_bound():
    def script(spec):
        return Outcome(fault="lost") if spec.index == 0 else mixed(spec)

    sched, _ = scheduler(script, tasks=("a",), groups_per_step=1, max_requeues=2, max_infra_retries=0,
                                 dynamic_sampling=False)
    [batch] = run(batches(sched, 1))
    dead = batch.groups[0].rollouts[0]
    assert dead.masked and dead.status == "infra_error" and dead.infra_cause.startswith("worker_lost")
    assert sched.stats()["requeued"] == 3 and sched.stats()["infra_by_cause"] == {"worker_lost": 1}


def test_rollout_time_budget_is_the_agents_wall_time_and_is_scored_not_masked():
    # A slow policy must not turn its failures into masked rollouts: the budget is the episode's wall time, and a
    # rollout that runs out of it is graded (stop reason wall_time), as the agent loop does.
    def script(spec):
        slow = spec.index == 0
        return Outcome(reward=float(spec.index % 2), turns=50 if slow else 1, turn_seconds=0.02 if slow else 0.001)

    sched, transport = scheduler(script, tasks=("a",), groups_per_step=1, rollout_time_budget=0.2,
                                 dynamic_sampling=False)
    [batch] = run(batches(sched, 1))
    slow = batch.groups[0].rollouts[0]
    assert (slow.status, slow.reward, slow.stop_reason) == ("graded", 0.0, "wall_time") and not slow.masked
    assert 0 < len(slow.trajectory.turns) < 50 and all(0 < s.wall_time <= 0.2 + 1e-9 for s in transport.runs)
    assert batch.masks == [1, 1, 1, 1] and sched.stats()["cancelled"] == 0


def test_group_time_budget_cancels_rollouts_that_have_not_started():
    # one slot: the group's rollouts run one after another; 0.6 s each against a 1 s group budget (0.4 s of slack
    # either way: the first must finish, the second must not)
    sched, transport = scheduler(lambda s: Outcome(reward=float(s.index % 2), turns=3, turn_seconds=0.2),
                                 tasks=("a",), capacity=1, groups_per_step=1, group_time_budget=1.0,
                                 dynamic_sampling=False)
    [batch] = run(batches(sched, 1))
    outcomes = [(r.status, r.stop_reason) for r in batch.groups[0].rollouts]
    # the second started with what was left of the group's budget as its wall time: scored when it ran out
    assert outcomes[:2] == [("graded", "finished"), ("graded", "wall_time")]
    assert outcomes[2:] == [("cancelled", "cancelled")] * 2 and len(transport.runs) == 2  # the last two never started


# Seeds, groups, dynamic sampling ---------------------------------------------------------------------------------
def test_seeds_are_reproducible_and_distinct():
    def seeds(run_seed):
        sched, _ = scheduler(mixed, run_seed=run_seed)
        got = run(batches(sched, 3))
        return [(r.group_id, r.index, r.seed) for b in got for r in b.rollouts]

    first, again, other = seeds(7), seeds(7), seeds(8)
    assert first == again
    assert len({s for _, _, s in first}) == len(first) == 3 * 2 * 4
    assert {s for _, _, s in first}.isdisjoint({s for _, _, s in other})
    for group, index, seed in first:
        task, k = group.split("@")
        assert seed == rollout_seed(7, task, int(k) * 4 + index)


def test_zero_variance_groups_are_dropped_refilled_and_counted():
    def script(spec):
        k = int(spec.group_id.split("@")[1])
        return Outcome(reward=1.0) if k < 2 else mixed(spec)  # the first two groups all solve it

    sched, transport = scheduler(script, tasks=("a",), groups_per_step=2)
    [batch] = run(batches(sched, 1))
    assert [g.group_id for g in batch.groups] == ["a@2", "a@3"]
    stats = sched.stats()
    assert stats["dropped_zero_variance"] == 2 and stats["zero_variance_groups"] == 2
    assert stats["groups_completed"] == 4
    # the dropped groups still taught the curriculum the task's pass rate (4 of them, 16 rollouts)
    assert sched.curriculum.tasks["a"].attempts == 16
    # a refill draws new samples, not the dropped group's again
    assert len({s.seed for s in transport.runs}) == 16


def test_refills_are_bounded():
    sched, _ = scheduler(lambda s: Outcome(reward=1.0), tasks=("a",), groups_per_step=1, max_refills=2)
    [batch] = run(batches(sched, 1))
    assert batch.advantages == [0.0] * 4
    stats = sched.stats()
    assert stats["dropped_zero_variance"] == 2 and stats["kept_zero_variance"] == 1


def test_shaping_is_added_before_advantages():
    class Bonus:
        name = "first"

        def __call__(self, rollout):
            return 0.5 if rollout.index == 0 else 0.0

    sched, _ = scheduler(lambda s: Outcome(reward=0.0), tasks=("a",), groups_per_step=1, shaping=[Bonus()])
    [batch] = run(batches(sched, 1))
    rollouts = batch.groups[0].rollouts
    assert [r.reward for r in rollouts] == [0.0] * 4  # the grader's reward is kept
    assert rollouts[0].shaping == {"first": 0.5} and rollouts[1].shaping == {"first": 0.0}
    assert batch.advantages == pytest.approx([0.375, -0.125, -0.125, -0.125])


def test_group_shaping_sees_the_whole_group_and_its_tier_before_the_rollout_terms():
    class Rank:
        name = "rank"

        def group(self, rollouts, tier):
            return [0.1 * tier * r.index for r in rollouts]

    class Reads:  # a rollout term that reads the others (as HackPenalty does)
        name = "reads"

        def __call__(self, rollout):
            return -rollout.shaping["rank"]

    sched, _ = scheduler(lambda s: Outcome(reward=0.0), tasks=("a",), groups_per_step=1, shaping=[Reads()],
                         group_shaping=[Rank()])
    [batch] = run(batches(sched, 1))
    tier = sched.curriculum.tasks["a"].difficulty.tier
    rollouts = batch.groups[0].rollouts
    assert [r.shaping["rank"] for r in rollouts] == pytest.approx([0.1 * tier * i for i in range(4)])
    assert all(r.shaping["reads"] == -r.shaping["rank"] for r in rollouts) and batch.advantages == [0.0] * 4


def test_in_flight_is_bounded_by_max_in_flight():
    sched, transport = scheduler(lambda s: Outcome(reward=float(s.index % 2), turn_seconds=0.01), capacity=8,
                                 max_in_flight=3, max_staleness=2)
    run(batches(sched, 2))
    assert transport.peak == 3


# Eval and shutdown -----------------------------------------------------------------------------------------------
def test_evaluate_runs_one_group_per_task_without_training():
    seen = []
    sched, _ = scheduler(lambda s: Outcome(reward=1.0, fault="infra" if s.index == 1 else None),
                                 tasks=("a", "b", "c"), max_infra_retries=1)

    async def go():
        try:
            return await sched.evaluate(["a", "c"], 3, progress=seen.append)
        finally:
            await sched.close()

    results = run(go())
    assert sorted(results) == ["a", "c"]
    for task, rollouts in results.items():
        assert [r.index for r in rollouts] == [0, 1, 2]
        assert [r.seed for r in rollouts] == [rollout_seed(0, task, i) for i in range(3)]
        assert [r.masked for r in rollouts] == [False, True, False]  # retried once, then masked
        assert all(r.advantage is None for r in rollouts)  # no zero-variance drop, no advantages
    assert len(seen) == 6
    assert all(s.attempts == 0 for s in sched.curriculum.tasks.values())
    assert sched.stats()["infra_retries"] == 2


def test_close_cancels_running_episodes_and_closes_the_transport():
    sched, transport = scheduler(lambda s: Outcome(turns=10_000, turn_seconds=0.01))

    async def go():
        pending = asyncio.create_task(sched.next_batch())
        await asyncio.sleep(0.1)
        assert transport.running == 4
        await sched.close()
        with pytest.raises(RuntimeError, match="closed"):
            await pending

    run(go())
    assert transport.closed and transport.running == 0


# Through real episodes -------------------------------------------------------------------------------------------
@needs_sandbox
def test_training_batch_through_in_process_episodes(taskset):
    """The gold replay engine through InProcessTransport, LocalEnvironment sandboxes and the real grader: every
    rollout is solved, so the first group to finish has no signal and is dropped; the bound (max_refills 1) keeps
    the next. The replay engine's version is -1 (never on-policy), one behind the trainer: max_staleness 1."""
    from shipyard.rollout.environment import LocalEnvironment
    from shipyard.rollout.episode import episode_config
    from shipyard.rollout.gold import gold_engine
    from shipyard.rollout.transport import InProcessTransport
    from shipyard.sandbox.host import host
    from shipyard.sandbox.sandbox import shipyard_source
    from shipyard.tasks.taskset import list_tasks
    from shipyard.train.batch import Batch

    shipyard_source(host())  # made once before two sandboxes start at once (see tests/rollout/test_eval.py)
    tasks_dir, _, _ = taskset
    task = list_tasks(tasks_dir)[0]
    engine = gold_engine(tasks_dir, [task])
    config = episode_config(engine.name, max_turns=8, grade_timeout=300, max_new_tokens=engine.longest() + 8)
    with LocalEnvironment() as env:
        transport = InProcessTransport(engine, env, config, workers=2)
        cfg = SchedulerConfig(group_size=2, groups_per_step=1, max_staleness=1, run_seed=3, max_refills=1)
        sched = Scheduler(cfg, transport, tasks_dir, curriculum(task))

        async def go():
            try:
                return await sched.next_batch()
            finally:
                await sched.close()

        batch = asyncio.run(asyncio.wait_for(go(), timeout=280))
    [group] = batch.groups
    assert group.group_id in (f"{task}@0", f"{task}@1")  # η = 1: two groups start at once
    assert [r.status for r in group.rollouts] == ["graded", "graded"] and batch.masks == [1, 1]
    assert [r.reward for r in group.rollouts] == [1.0, 1.0] and batch.advantages == [0.0, 0.0]
    k = int(group.group_id.split("@")[1])
    assert [r.seed for r in group.rollouts] == [rollout_seed(3, task, 2 * k), rollout_seed(3, task, 2 * k + 1)]
    assert all(r.worker == "in-process" and r.trajectory.turns for r in group.rollouts)
    stats = sched.stats()
    assert stats["dropped_zero_variance"] == 1 and stats["kept_zero_variance"] == 1 and stats["started"] >= 4
    tensors = Batch.from_rollouts(batch, pad_id=0)
    assert tensors.size == 2 and tensors.tokens == sum(len(t.completion_ids) for r in group.rollouts
                                                       for t in r.trajectory.turns)
    assert set(tensors.versions[tensors.loss_mask.bool()].tolist()) == {-1}  # replayed: never on-policy


def test_rollout_benchmark_runs_both_modes_and_ends_with_its_figures():
    proc = subprocess.run([sys.executable, "-m", "shipyard.bench.rollout", "--steps", "3", "--groups", "2",
                           "--group-size", "2", "--engines", "2", "--max-batch", "2", "--workers", "8",
                           "--scale", "0.05", "--max-steps", "20"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "rollout"
    assert figures["sync_rollouts_per_s"] > 0 and figures["async_rollouts_per_s"] > 0
    assert 0 < figures["bound_fraction"] <= 1.0 and figures["ratio"] > 0
    staleness = figures["staleness"]
    assert staleness["stale_tokens"] == "mask" and 0 < staleness["trained_token_fraction"] <= 1
    assert staleness["masked_stale_tokens"] >= 0 and staleness["dropped_stale_groups"] >= 0


def test_training_with_groups_of_one_is_refused_before_any_rollout_runs():
    """Review: with group_size 1 no group has a baseline, so every advantage is 0 and (with dynamic sampling) every
    group was dropped and refilled `max_refills` times per batch — rollouts spent for a batch that teaches nothing.
    Evaluation (`evaluate`) may still run single samples."""
    sched, _ = scheduler(mixed, group_size=1)

    async def go():
        try:
            with pytest.raises(ValueError, match="group_size"):
                await sched.next_batch()
            assert sched.counters["started"] == 0
            assert len((await sched.evaluate(["a"], samples=1))["a"]) == 1
        finally:
            await sched.close()

    run(go())


def test_a_rollout_returned_for_another_spec_is_a_transport_bug_not_a_group_member():
    """Review: a transport (a Ray worker mixing up its results, say) that answers one spec with another's rollout
    had that rollout silently counted in the wrong group's advantages. It reaches the caller as a bug."""
    sched, transport = scheduler(mixed)
    honest = transport.run

    async def mixed_up(spec, cancelled):
        rollout = await honest(spec, cancelled)
        rollout.index = spec.index + 1
        return rollout

    transport.run = mixed_up

    async def go():
        try:
            with pytest.raises(RuntimeError, match="another spec"):
                await sched.next_batch()
        finally:
            await sched.close()

    run(go())
