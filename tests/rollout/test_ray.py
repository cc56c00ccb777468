"""The Ray transport on a local Ray (2 CPUs): real rollouts through the real scheduler, real sandboxes behind an
environment-server actor, engines as actors — and the faults it exists for: a rollout worker killed mid-rollout
(its rollout is re-queued and completes, counted) and an engine actor killed mid-rollout (the rollouts fail over to
the other engine; with no engine left they come back infra_error, masked — never a silent zero)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from schedfakes import wait_until
from servers import needs_sandbox

ray = pytest.importorskip("ray")

from shipyard.rollout.episode import episode_config  # noqa: E402
from shipyard.rollout.gold import gold_scripts  # noqa: E402
from shipyard.rollout.ray_transport import RayConfig, RayTransport  # noqa: E402
from shipyard.rollout.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from shipyard.tasks.taskset import list_tasks  # noqa: E402

pytestmark = needs_sandbox

SLEEP = 4  # seconds the slow scripts' first command runs: the window in which a test kills something


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (2 CPUs, as a small CI machine has); transports join it and leave it running."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def terminal(command: str) -> str:
    return ("Running it.\n<tool_call>\n" + json.dumps({"name": "run_terminal", "arguments": {"command": command}})
            + "\n</tool_call>\n")


def replay_file(tasks_dir: Path, out: Path, first: list[str] = ()) -> str:
    """A `replay:` model whose script for every task is `first`, then the task's gold trajectory (reward 1)."""
    scripts = gold_scripts(tasks_dir)
    out.write_text("".join(json.dumps({"task": t, "messages": [*first, *m]}) + "\n" for t, m in scripts.items()))
    return f"replay:{out}"


def transport(model: str, tasks_dir: Path, episode: dict | None = None, **changes) -> RayTransport:
    settings = dict(max_turns=8, max_new_tokens=4096, monitors=False, grade_timeout=300)
    config = episode_config(model, **{**settings, **(episode or {})})
    options = dict(engines=2, workers=2, concurrency=2, env_servers=1, allowed_roots=(tasks_dir,), engine_cpus=0.5)
    return RayTransport(model, config, RayConfig(**{**options, **changes}))


def evaluate(scheduler: Scheduler, tasks: list[str], samples: int, during=None, after=None, close: bool = True):
    """Scheduler.evaluate, with `during()` run alongside it (the fault to inject) and `after()` once it returned;
    then the scheduler closes, and with it the transport, unless `close` is false."""

    async def go():
        job = asyncio.create_task(scheduler.evaluate(tasks, samples))
        if during is not None:
            await during()
        results = await job
        if after is not None:
            after()
        if close:
            await scheduler.close()
        return results

    return asyncio.run(go())


def rollouts_of(results) -> list:
    return [r for group in results.values() for r in group]


def test_tiny_model_rollouts_and_weight_updates_on_a_ray_it_starts(taskset):
    """The tiny random model in an engine actor, new weights pushed through the object store, a completion cancelled
    across the process boundary, a rollout stopped by its time budget, two rollouts graded in the worker's own
    sandboxes (no environment server: LocalEnvironment). This test runs first, before the module's Ray: the transport
    starts one (num_cpus=2) and, having started it, shuts it down on close — also when an assertion fails, so that
    the module's Ray can start after it."""
    import torch

    from shipyard.models.engine import GenerationRequest, SamplingParams
    from shipyard.models.resolve import TINY, tiny_model
    from shipyard.rollout.ray_actors import RayEngine

    tasks_dir = taskset[0]
    task = list_tasks(tasks_dir)[0]
    started = not ray.is_initialized()
    t = transport(TINY, tasks_dir, {"max_turns": 2, "max_new_tokens": 24}, num_cpus=2, engines=1, workers=1,
                  concurrency=2, env_servers=0, allowed_roots=())
    try:
        assert t.started_ray == started and ray.is_initialized()
        model, _ = tiny_model(seed=1)
        asyncio.run(t.update_weights(1, {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}))

        # The caller's cancel callback is polled on the driver and reaches the actor between decode steps (after 3 s:
        # three polls, 0.3 s, were too few for a first token on a loaded machine in CI).
        since = time.monotonic()
        endless = GenerationRequest(t.engine_infos[0].tokenizer.encode("count"),
                                    SamplingParams(max_tokens=20_000, temperature=0.0),
                                    cancelled=lambda: time.monotonic() > since + 3)
        [aborted] = RayEngine(t.engine_infos[0]).generate([endless])
        assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 20_000

        # A time budget crosses the process boundary (in the spec): the episode stops with wall_time and is scored.
        # 1 ms is spent before the first decode step (the sandbox lists the workspace), so the outcome is certain.
        budget = Scheduler(SchedulerConfig(rollout_time_budget=1e-3, max_infra_retries=0), t, tasks_dir)
        stopped = rollouts_of(evaluate(budget, [task], samples=1, close=False))
        assert [(r.reward, r.stop_reason) for r in stopped] == [(0.0, "wall_time")], \
            [(r.status, r.infra_cause, r.timings) for r in stopped]
        assert stopped[0].trajectory.stop_reason == "wall_time" and stopped[0].timings["total"] < 60

        rollouts = rollouts_of(evaluate(Scheduler(SchedulerConfig(), t, tasks_dir), [task], samples=2))
        assert len(rollouts) == 2 and rollouts[0].seed != rollouts[1].seed
        for r in rollouts:
            # 24 tokens of the tiny random model fix nothing: graded, and scored 0
            assert (r.status, r.reward) == ("graded", 0.0), (r.status, r.infra_cause)
            assert r.trajectory.turns and set(r.versions) == {1}  # sampled by the pushed weights
            assert r.engine == f"router[{TINY}@ray-engine-0]" and r.worker == "ray-worker-0"
        assert ray.is_initialized() != started  # Scheduler.close closed the transport, which stopped the Ray it started
    finally:
        asyncio.run(t.close())  # idempotent: a second close after Scheduler.close does nothing


def test_killed_worker_rollouts_are_requeued_and_complete(local_ray, taskset, tmp_path):
    """Scripted gold rollouts of every task (each first runs a slow command) on two workers; worker 0 is killed
    while it runs two of them. Both are re-queued, counted, rerun on its replacement, and every rollout scores 1."""
    tasks_dir = taskset[0]
    tasks = list_tasks(tasks_dir)
    model = replay_file(tasks_dir, tmp_path / "slow.jsonl", first=[terminal(f"sleep {SLEEP}")])
    t = transport(model, tasks_dir, engines=1, workers=2, concurrency=2)
    try:
        assert t.capacity() == 4
        victim = t.worker(0)
        old_pid = ray.get(victim.ready.remote())
        scheduler = Scheduler(SchedulerConfig(max_requeues=2), t, tasks_dir)

        async def kill_worker_mid_rollout():
            await wait_until(lambda: t.slots[0].in_flight > 0)
            await asyncio.sleep(SLEEP / 2 + 1)  # inside its first command, after sandbox start and one turn
            assert t.slots[0].in_flight > 0
            ray.kill(victim, no_restart=True)

        pids = []
        results = evaluate(scheduler, tasks, samples=1, during=kill_worker_mid_rollout,
                           after=lambda: pids.append(ray.get(t.worker(0).ready.remote())))
        rollouts = rollouts_of(results)
        assert sorted(results) == sorted(tasks) and len(rollouts) == len(tasks)  # nothing lost
        assert [(r.status, r.reward) for r in rollouts] == [("graded", 1.0)] * len(rollouts), \
            [(r.status, r.infra_cause) for r in rollouts]
        assert all(r.trajectory.turns and r.attempt == 0 for r in rollouts)  # re-queued unchanged, not retried
        stats = scheduler.stats()
        assert t.stats()["workers_lost"] >= 1 and t.stats()["workers_replaced"] == 1
        assert stats["requeued"] == t.stats()["workers_lost"] and stats["infra_retries"] == 0, stats
        assert pids[0] != old_pid  # a replacement runs in the slot
        assert all(r.worker != "ray-worker-0" for r in rollouts)  # what the dead worker held ran again elsewhere
        assert "ray-worker-0.1" in {r.worker for r in rollouts}  # on the replacement, the least loaded slot
    finally:
        asyncio.run(t.close())


def test_killed_engines_fail_over_then_come_back_infra_error(local_ray, taskset, tmp_path):
    """Two engine actors. Killing one mid-rollout: its rollouts continue on the other (the routers fail over) and
    score 1. Then killing the last one mid-rollout: the rollouts come back infra_error, are retried, and end masked
    (reward None), every failure counted by cause — never a silent zero."""
    tasks_dir = taskset[0]
    tasks = list_tasks(tasks_dir)
    model = replay_file(tasks_dir, tmp_path / "slow.jsonl", first=[terminal(f"sleep {SLEEP}")])
    t = transport(model, tasks_dir, engines=2, workers=1, concurrency=2)
    try:
        def kill_mid_rollout(engine: int, rollouts: int):
            async def kill():
                await wait_until(lambda: t.slots[0].in_flight == rollouts)
                await asyncio.sleep(SLEEP / 2 + 1)  # every rollout has had its first turn and is in its command
                ray.kill(t.engines[engine], no_restart=True)
            return kill

        # Each phase runs tasks of its own: a replay engine's scripts are per conversation (rollout id).
        first = Scheduler(SchedulerConfig(), t, tasks_dir)
        rollouts = rollouts_of(evaluate(first, tasks[:2], samples=1, during=kill_mid_rollout(0, 2), close=False))
        assert [(r.status, r.reward) for r in rollouts] == [("graded", 1.0)] * 2, \
            [(r.status, r.infra_cause) for r in rollouts]
        assert first.stats()["infra_retries"] == 0  # failed over inside the episode, not retried

        second = Scheduler(SchedulerConfig(max_infra_retries=1), t, tasks_dir)
        rollouts = rollouts_of(evaluate(second, tasks[2:], samples=2, during=kill_mid_rollout(1, 2)))
        assert len(rollouts) == 2
        for r in rollouts:
            assert (r.status, r.reward, r.stop_reason) == ("infra_error", None, "infra_error") and r.masked
            assert "ActorDiedError" in r.infra_cause and r.trajectory.stop_reason == "infra_error", r.infra_cause
        stats = second.stats()
        assert stats["masked_infra"] == 2 and stats["infra_retries"] == 2, stats
        assert sum(stats["infra_by_cause"].values()) == 4, stats
    finally:
        asyncio.run(t.close())
