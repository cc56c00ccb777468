"""A scheduler's state round-trips: a run resumed from `state()` hands out the batches the uninterrupted run would
have (same groups, seeds and rewards), the groups in play when the state was taken are run again, and the state is
JSON (it goes into a checkpoint)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from schedfakes import Outcome, ScriptedTransport

from shipyard.rollout.scheduler import Scheduler, SchedulerConfig
from shipyard.tasks.curriculum import Curriculum, Difficulty

TASKS = Path("/nonexistent-tasks")


def scheduler(eta: int, capacity: int) -> Scheduler:
    def script(spec):  # deterministic in the spec: a reward pattern that varies by task and sample
        return Outcome(reward=float((spec.seed + spec.index) % 2), turns=1 + spec.seed % 3, turn_seconds=0.001)

    cfg = SchedulerConfig(group_size=2, groups_per_step=2, max_staleness=eta, run_seed=7)
    cur = Curriculum({t: Difficulty(1, 1, 1, 1) for t in ("a", "b", "c", "d")})
    return Scheduler(cfg, ScriptedTransport(script, capacity=capacity), TASKS, cur)


def fingerprint(batch) -> list[tuple]:
    return [(r.group_id, r.index, r.seed, r.reward, r.advantage) for r in batch.rollouts]


async def run(sched: Scheduler, first_version: int, steps: int, save_after: int | None = None):
    """Batches for versions first_version … first_version+steps−1; the state after `save_after` batches' updates."""
    out, saved = [], None
    if first_version:
        await sched.restore_weights({})
    for i in range(steps):
        v = first_version + i
        batch = await sched.next_batch()
        assert batch.trainer_version == v
        out.append(fingerprint(batch))
        await sched.update_weights(v + 1, {})
        if save_after is not None and i + 1 == save_after:
            saved = json.loads(json.dumps(sched.state()))  # as a checkpoint stores it
    await sched.close()
    return out, saved


@pytest.mark.parametrize("capacity", [1, 8])
def test_a_resumed_synchronous_scheduler_hands_out_the_batches_the_uninterrupted_one_would(capacity):
    """η = 0: a run is a function of its seeds, so a resumed run continues it exactly."""
    whole, state = asyncio.run(asyncio.wait_for(run(scheduler(0, capacity), 0, 6, save_after=3), timeout=30))
    assert len(state["pending"]) in (0, 2)  # the next batch's groups, if they had started: they start again
    resumed = scheduler(0, capacity)
    resumed.load_state(state)
    rest, _ = asyncio.run(asyncio.wait_for(run(resumed, 3, 3), timeout=30))
    assert rest == whole[3:]
    stats = resumed.stats()
    assert stats["batches"] == 6 and stats["trainer_version"] == 6 and stats["updates"] == 6


def test_an_asynchronous_resume_reruns_the_groups_in_play_and_never_reuses_a_seed():
    """η ≥ 1: which groups finish first depends on timing (so does an uninterrupted run), but nothing is lost: the
    groups in play at the save run again first, with their seeds, their curriculum evidence is not counted twice, and
    every later group draws new seeds."""
    whole, state = asyncio.run(asyncio.wait_for(run(scheduler(2, 3), 0, 4, save_after=2), timeout=30))
    pending = [f"{e['task']}@{e['k']}" for e in state["pending"]]
    assert pending
    resumed = scheduler(2, 3)
    resumed.load_state(state)
    attempts_before = {t: s["attempts"] for t, s in state["curriculum"]["tasks"].items()}
    rest, _ = asyncio.run(asyncio.wait_for(run(resumed, 2, 2), timeout=30))
    first_started = [spec.group_id for spec, _ in resumed.transport.starts][:2 * len(pending)]
    assert sorted(set(first_started)) == sorted(pending)
    seeds_before = {s for b in whole[:2] for (_, _, s, _, _) in b}
    seeds_after = [s for b in rest for (_, _, s, _, _) in b]
    assert not seeds_before & set(seeds_after) and len(set(seeds_after)) == len(seeds_after)
    recorded = [e for e in state["pending"] if e["recorded"]]
    for e in recorded:  # a group recorded before the save is not recorded again when it reruns
        assert resumed.curriculum.tasks[e["task"]].attempts >= attempts_before[e["task"]]
    assert sum(s.attempts for s in resumed.curriculum.tasks.values()) == \
        sum(attempts_before.values()) + 2 * (resumed.stats()["groups_completed"] - state["counters"]["groups_completed"]
                                             - len(recorded))


def test_load_state_refuses_a_running_scheduler():
    sched = scheduler(1, 2)

    async def go():
        await sched.next_batch()
        with pytest.raises(RuntimeError, match="before the first next_batch"):
            sched.load_state(sched.state())
        await sched.close()

    asyncio.run(asyncio.wait_for(go(), timeout=30))
