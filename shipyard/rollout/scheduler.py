"""The rollout scheduler: groups from the curriculum, seeds, retries, budgets, advantages, bounded staleness.

One asyncio scheduler drives any `Transport` (in-process threads or Ray actors). For training it keeps a
background producer starting *groups* — N rollouts of one task drawn from the curriculum — as long as the
staleness gate allows (`staleness.py`), and `next_batch` hands out G complete groups with their advantages. The
engines never wait for the trainer (unless `max_staleness = 0`, the synchronous algorithm) and the trainer never
waits for the slowest rollout of a batch: groups are taken in the order they complete.

**Seeds.** The k-th group of task T runs samples k·N … k·N+N−1 of T: rollout i of it has seed
`rollout_seed(run_seed, T, k·N + i)`. A rerun with the same run seed draws the same samples, the rollouts of a
group draw distinct ones, and a group that replaces a dropped one draws new ones. Evaluation runs group 0.

**Faults are data.** A rollout that comes back `infra_error` is run again with the same seed (attempt + 1) up to
`max_infra_retries` times, then kept masked (reward None: no advantage, mask 0); each failure is counted by cause
(the part of `infra_cause` before the first colon). A worker that dies (`WorkerLost`) returned nothing: its spec
goes back in the queue unchanged, counted, up to `max_requeues` times (then masked, cause `worker_lost`), so no
rollout is ever lost. Time budgets (per rollout attempt, per group from its first start) are the model's: a running
episode gets what is left as its wall time (`EpisodeSpec.wall_time`) and, when it runs out — between decode steps
too — stops with `wall_time` and is graded, so a slow policy cannot turn its failures into masked rollouts. Only
what the model cannot cause masks: a rollout whose group's budget ran out before it started, a doomed group, shutdown.

**Advantages** (`advantages.py`): shaping terms are added to each rewarded rollout (group terms such as
`EffortCalibration` first, with the task's curriculum tier), then group-relative
advantages (mean or leave-one-out baseline, optional std normalisation). With `dynamic_sampling`, a group without
signal (zero reward variance) is dropped and replaced (DAPO), counted; at most `max_refills` replacements per
batch, after which such groups are kept (their advantages are 0), so the loop always ends. Every group's rewards
are recorded in the curriculum, dropped or not: they are evidence of the task's pass rate.

**Staleness** (`staleness.py`): groups start only while the gate admits them. A batch trains only on tokens at most
`max_staleness` versions old (`RolloutBatch.min_version`); with `stale_tokens = "mask"` a straggler's older tokens
are context, and a group with nothing fresh left is dropped at hand-out. With `"drop"`, a complete group with any
older token is dropped, and a running group whose first-started rollout falls more than `max_staleness` versions
behind at a weight update is *doomed* — it would be dropped — so its episodes are cancelled at once (`doomed_groups`)
and its place goes to a fresh group. More stale drops in a row than the groups admitted ahead can explain means the
engines are not receiving the weights: `next_batch` raises instead of looping.

**Resuming** (`state`/`load_state`, JSON for a checkpoint): the task sampler's random state, the groups started
per task (so seeds continue), the curriculum, the gate and the counters, plus the groups in play — started and not
yet taken or dropped — which a resumed scheduler starts again first with their seeds (their curriculum evidence, if
already recorded, is not counted twice); `restore_weights` then gives the fresh engines the restored policy. A batch
lists its groups in the order they started, so with η = 0 a run is a function of its seeds and a resumed run hands
out exactly the batches the uninterrupted one would have (tested); with η ≥ 1 which groups finish first depends on
timing, in a resumed run as in any other, and nothing in play is lost.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from shipyard.errors import UsageError
from shipyard.models.errors import InfraError
from shipyard.rollout.advantages import GroupShapingTerm, ShapingTerm, group_advantages, no_signal, shaped_rewards
from shipyard.rollout.batches import RolloutBatch, RolloutGroup
from shipyard.rollout.record import EpisodeSpec, Rollout, rollout_seed
from shipyard.rollout.staleness import STALE_TOKENS, StalenessGate
from shipyard.rollout.transport import Transport, WorkerLost
from shipyard.tasks.curriculum import Curriculum

if TYPE_CHECKING:
    import torch


@dataclass
class SchedulerConfig:
    group_size: int = 8  # N rollouts per task per group
    groups_per_step: int = 4  # G groups per trainer batch
    max_staleness: int = 1  # η: trained tokens are at most η versions behind the trainer; 0 = synchronous
    stale_tokens: Literal["mask", "drop"] = "mask"  # older tokens: kept as context, not trained | their group dropped
    run_seed: int = 0
    std_normalize: bool = False  # divide advantages by the group's std (GRPO); off: Dr. GRPO's unbiased form
    leave_one_out: bool = False  # RLOO baseline instead of the group mean
    dynamic_sampling: bool = True  # drop and replace zero-variance groups (DAPO)
    max_refills: int = 16  # replacements per batch before zero-variance groups are kept
    max_infra_retries: int = 2  # extra attempts (same seed) after an infra_error, then masked
    max_requeues: int = 8  # re-runs of a spec whose worker died, then masked
    max_in_flight: int | None = None  # concurrent episodes; None = the transport's capacity
    rollout_time_budget: float | None = None  # seconds per attempt
    group_time_budget: float | None = None  # seconds from a group's first start
    close_timeout: float = 60.0  # seconds `close` waits for episodes to notice cancellation

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.groups_per_step < 1:
            raise ValueError("group_size and groups_per_step must be at least 1")
        if min(self.max_refills, self.max_infra_retries, self.max_requeues, self.max_staleness) < 0:
            raise ValueError("max_refills, max_infra_retries, max_requeues and max_staleness must be >= 0")
        if self.stale_tokens not in STALE_TOKENS:
            raise ValueError(f"stale_tokens must be one of {STALE_TOKENS}, got {self.stale_tokens!r}")
        budgets = (self.rollout_time_budget, self.group_time_budget, self.close_timeout)
        if any(b is not None and not b > 0 for b in budgets):  # 0: every attempt cancelled before it starts
            raise ValueError(f"rollout_time_budget, group_time_budget (None: none) and close_timeout must be > 0 "
                             f"seconds, got {budgets}")


@dataclass(eq=False)
class _Flight:
    """A group while it runs: when its first rollout began, the trainer version then, and whether it is doomed."""

    start: float | None = None
    begun_version: int | None = None
    doomed: bool = False


def infra_kind(cause: str | None) -> str:
    """The counted kind of an infra cause: its text before the first colon (typically the exception's name)."""
    return (cause or "unknown").split(":", 1)[0].strip() or "unknown"


class Scheduler:
    def __init__(self, config: SchedulerConfig, transport: Transport, tasks_dir: Path,
                 curriculum: Curriculum | None = None, shaping: Sequence[ShapingTerm] = (),
                 group_shaping: Sequence[GroupShapingTerm] = ()):
        self.config, self.transport, self.tasks_dir = config, transport, Path(tasks_dir)
        self.curriculum = curriculum if curriculum is not None else Curriculum.from_taskset(self.tasks_dir)
        self.shaping, self.group_shaping = tuple(shaping), tuple(group_shaping)
        self.gate = StalenessGate(config.max_staleness, config.groups_per_step, config.stale_tokens)
        self.counters: Counter = Counter()
        self.infra_causes: Counter = Counter()
        self.last_infra_cause = ""  # the newest infra failure's full cause, for the error that gives up
        self._rng = random.Random(config.run_seed)
        self._slots = asyncio.Semaphore(config.max_in_flight or transport.capacity())
        self._cond = asyncio.Condition()
        self._ready: list[RolloutGroup] = []
        self._groups_of: Counter = Counter()  # task -> groups started
        self._tasks: set[asyncio.Task] = set()
        self._flights: set[_Flight] = set()  # training groups running
        self._producer: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._closing = False
        self._in_flight = 0
        self._step = 0
        self._refills = 0  # this batch's
        self._seq = 0  # groups started, in order: a batch lists its groups in this order
        self._pending: dict[str, dict] = {}  # group id -> how to start it again: started, not yet taken or dropped
        self._resume: list[dict] = []  # groups to start again first, after `load_state`

    # Training ----------------------------------------------------------------------------------------------
    async def next_batch(self) -> RolloutBatch:
        """The next G accepted groups (oldest policy first among those complete), within the staleness bound."""
        if self._closing:
            raise RuntimeError("the scheduler is closed")
        if self.config.group_size < 2:  # no baseline: every advantage would be 0 (evaluate may run single samples)
            raise UsageError(f"training needs group_size >= 2 (got {self.config.group_size}): group-relative "
                             "advantages compare the rollouts of a group, and one rollout has nothing to compare with")
        if self._producer is None:
            self._producer = asyncio.create_task(self._produce())
        chosen: list[RolloutGroup] = []
        stale_in_a_row = 0
        async with self._cond:
            while len(chosen) < self.config.groups_per_step:
                await self._cond.wait_for(lambda: self._ready or self._error is not None or self._closing)
                if self._error is not None:
                    raise self._error
                if self._closing:
                    raise RuntimeError("the scheduler was closed while a batch was being made")
                self._ready.sort(key=lambda g: g.oldest_version)
                group = self._ready.pop(0)
                if self.gate.fresh(group.rollouts, group.started_version):
                    chosen.append(group)
                    self._pending.pop(group.group_id, None)
                    stale_in_a_row = 0
                    continue
                self._pending.pop(group.group_id, None)
                self.gate.dropped += 1
                self.gate.released()
                self.counters["dropped_stale_rollouts"] += len(group.rollouts)
                self._cond.notify_all()
                stale_in_a_row += 1
                if stale_in_a_row > 2 * (self.config.max_staleness + 1) * self.config.groups_per_step:
                    # more than every group admitted ahead could explain: the engines are behind the trainer
                    raise RuntimeError(
                        f"{stale_in_a_row} groups in a row were sampled more than {self.config.max_staleness} "
                        f"versions behind the trainer (version {self.gate.version}; this one's turns: "
                        f"{sorted({v for r in group.rollouts for v in r.versions})}): the engines are not receiving "
                        f"the weights pushed by update_weights, or their versions are not the trainer's (a replay "
                        f"engine's are -1: use max_staleness >= 1 with it)")
        chosen.sort(key=lambda g: g.seq)  # the order they started: the same batch whatever order they finished in
        for group in chosen:
            self.gate.accept(group.rollouts, group.started_version)
        self._step += 1
        self._refills = 0
        batch = RolloutBatch(chosen, step=self._step, trainer_version=self.gate.version,
                             min_version=self.gate.min_version)
        self.counters["batches"] += 1
        self.counters["accepted_rollouts"] += len(batch.rollouts)
        if not any(batch.masks):
            raise InfraError(f"every rollout of batch {self._step} failed ({dict(self.infra_causes)} infra failures "
                             f"by cause, {self.counters['cancelled']} cancelled; the last: {self.last_infra_cause!r}): "
                             f"check the environment server and engines, or raise the time budgets")
        return batch

    async def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Push weights to every engine, then let the next version's groups start."""
        await self.transport.update_weights(version, tensors)
        async with self._cond:
            self.gate.advance(version)
            for flight in self._flights if self.gate.dooms_running_groups else ():
                if not flight.doomed and flight.begun_version is not None and \
                        flight.begun_version < self.gate.version - self.config.max_staleness:
                    flight.doomed = True  # it would be dropped at acceptance: stop spending engines on it
                    self.counters["doomed_groups"] += 1
            self._cond.notify_all()

    async def _produce(self) -> None:
        try:
            while True:
                async with self._cond:
                    await self._cond.wait_for(lambda: self._closing or self._error is not None
                                              or self._resume or self.gate.may_start())
                    if self._closing or self._error is not None:
                        return
                    if self._resume:  # in play when the state was saved (and counted there): the same seeds again
                        entry = self._resume.pop(0)
                        task_id, k, started_version = entry["task"], entry["k"], entry["started_version"]
                        recorded = entry.get("recorded", False)
                    else:
                        task_id = self.curriculum.sample(1, self._rng)[0]
                        k, started_version, recorded = self._groups_of[task_id], self.gate.version, False
                        self._groups_of[task_id] += 1
                        self.gate.started()
                    seq, self._seq = self._seq, self._seq + 1
                    self._pending[f"{task_id}@{k}"] = {"task": task_id, "k": k, "started_version": started_version,
                                                       "seq": seq, "recorded": recorded}
                n = self.config.group_size
                specs = [EpisodeSpec(task_id, self.tasks_dir, f"{task_id}@{k}", i,
                                     rollout_seed(self.config.run_seed, task_id, k * n + i)) for i in range(n)]
                self._spawn(self._train_group(specs, started_version, seq))
                await asyncio.sleep(0)  # let the group's rollouts queue for slots before the next group's
        except Exception as e:  # handed to next_batch, which raises it to the caller
            await self._fail(e)

    def _tier(self, task_id: str) -> int:
        state = self.curriculum.tasks.get(task_id)
        return state.difficulty.tier if state is not None else 1

    async def _train_group(self, specs: list[EpisodeSpec], started_version: int, seq: int) -> None:
        try:
            group, doomed = await self._run_group(specs, started_version)
            group.seq = seq
            behind = [v for r in group.rollouts for v in r.versions if 0 <= v < started_version]
            if behind:  # weights reach every engine before the gate advances, so this cannot happen when they arrive
                raise RuntimeError(
                    f"group {group.group_id} started at trainer version {started_version}, but a turn of it was "
                    f"sampled by policy version {min(behind)}: an engine is not receiving the weights pushed by "
                    f"update_weights (an engine restarted with its initial weights, or left out of the transport's "
                    f"update). Its samples would be trained on as if they came from the pushed policy")
            if self._closing:
                return  # cut short by `close`: not evidence of anything
            rewards = shaped_rewards(group.rollouts, self.shaping, self.group_shaping, self._tier(group.task_id))
            entry = self._pending.get(group.group_id, {})
            if not entry.get("recorded"):  # a group re-run on resume was recorded before the state was saved
                self.curriculum.record(group.task_id, [r.reward for r in group.rollouts if r.reward is not None])
                entry["recorded"] = True
            self.counters["groups_completed"] += 1
            async with self._cond:
                if doomed:  # too stale to be accepted: dropped as such, without using up a refill
                    self._pending.pop(group.group_id, None)
                    self.gate.dropped += 1
                    self.gate.released()
                    self.counters["dropped_stale_rollouts"] += len(group.rollouts)
                    self._cond.notify_all()
                    return
                if no_signal(rewards):
                    self.counters["zero_variance_groups"] += 1
                    if self.config.dynamic_sampling and self._refills < self.config.max_refills:
                        self._refills += 1
                        self.counters["dropped_zero_variance"] += 1
                        self._pending.pop(group.group_id, None)
                        self.gate.released()  # the producer starts a replacement
                        self._cond.notify_all()
                        return
                    if self.config.dynamic_sampling:
                        self.counters["kept_zero_variance"] += 1
                advantages = group_advantages(rewards, std_normalize=self.config.std_normalize,
                                              leave_one_out=self.config.leave_one_out)
                for rollout, a in zip(group.rollouts, advantages, strict=True):
                    rollout.advantage = a
                self._ready.append(group)
                self._cond.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to next_batch
            await self._fail(e)

    async def _fail(self, error: BaseException) -> None:
        async with self._cond:
            self._error = self._error or error
            self._cond.notify_all()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # Running groups and rollouts ---------------------------------------------------------------------------
    async def _run_group(self, specs: list[EpisodeSpec], started_version: int) -> tuple[RolloutGroup, bool]:
        flight = _Flight()
        self._flights.add(flight)
        try:
            rollouts = await asyncio.gather(*(self._run_rollout(s, flight) for s in specs))
        finally:
            self._flights.discard(flight)
        first = flight.start if flight.start is not None else time.monotonic()
        return RolloutGroup(specs[0].task_id, specs[0].group_id, list(rollouts), started_version,
                            time.monotonic() - first), flight.doomed

    async def _run_rollout(self, spec: EpisodeSpec, flight: _Flight) -> Rollout:
        requeues = 0
        while True:
            async with self._slots:
                now = time.monotonic()
                if flight.start is None:
                    flight.start = now
                if flight.begun_version is None:
                    flight.begun_version = self.gate.version
                deadlines = [d for d in (self._deadline(flight.start, self.config.group_time_budget),
                                         self._deadline(now, self.config.rollout_time_budget)) if d is not None]
                deadline = min(deadlines, default=None)
                if self._closing or flight.doomed or (deadline is not None and now >= deadline):
                    # never started: masked, which the model cannot choose (its group's budget went to the others)
                    self.counters["cancelled"] += 1
                    self.counters["finished"] += 1
                    return Rollout(spec.task_id, spec.group_id, spec.index, spec.seed, "cancelled", None,
                                   attempt=spec.attempt, stop_reason="cancelled")
                # A running episode's budget is the agent's wall time: it stops with `wall_time` and is graded, so
                # a slow policy cannot turn its failures into masked rollouts. Cancellation (masked) is only what
                # the model cannot cause: a doomed group, shutdown.
                spec = replace(spec, wall_time=None if deadline is None else deadline - now)

                def cancelled() -> bool:
                    return self._closing or flight.doomed

                self.counters["started"] += 1
                self._in_flight += 1
                try:
                    rollout = await self.transport.run(spec, cancelled)
                except WorkerLost as e:
                    self.counters["requeued"] += 1
                    requeues += 1
                    if requeues <= self.config.max_requeues:
                        continue  # back of the queue: the slot is released, the same spec runs again
                    rollout = self._infra_rollout(spec, f"worker_lost: {e}")
                except InfraError as e:  # the contract says infra failures come back as records; be forgiving
                    rollout = self._infra_rollout(spec, f"{type(e).__name__}: {e}")
                finally:
                    self._in_flight -= 1
            if (rollout.task_id, rollout.group_id, rollout.index) != (spec.task_id, spec.group_id, spec.index):
                raise RuntimeError(f"the transport answered {spec.group_id}/{spec.index} with the rollout of another "
                                   f"spec ({rollout.group_id}/{rollout.index}): a transport bug")
            if rollout.status == "infra_error":
                self.infra_causes[infra_kind(rollout.infra_cause)] += 1
                self.last_infra_cause = (rollout.infra_cause or "")[:600]
                if spec.attempt < self.config.max_infra_retries and not self._closing:
                    self.counters["infra_retries"] += 1
                    spec = replace(spec, attempt=spec.attempt + 1)
                    continue
                self.counters["masked_infra"] += 1
            elif rollout.status == "cancelled":
                self.counters["cancelled"] += 1
            self.counters["finished"] += 1
            return rollout

    @staticmethod
    def _deadline(start: float, budget: float | None) -> float | None:
        return None if budget is None else start + budget

    @staticmethod
    def _infra_rollout(spec: EpisodeSpec, cause: str) -> Rollout:
        return Rollout(spec.task_id, spec.group_id, spec.index, spec.seed, "infra_error", None, attempt=spec.attempt,
                       stop_reason="infra_error", infra_cause=cause)

    # Evaluation --------------------------------------------------------------------------------------------
    async def evaluate(self, task_ids: list[str], samples: int, progress: Callable[[Rollout], None] | None = None,
                       done: Mapping[tuple[str, int], Rollout] | None = None) -> dict[str, list[Rollout]]:
        """`samples` rollouts of each task (seeds of group 0), infra failures retried then masked; no dynamic
        sampling, no advantages, nothing recorded in the curriculum. `progress` is called as each one finishes.
        `done` holds rollouts already finished, by (task, index) (a resumed eval): they are returned, not run."""
        if samples < 1:
            raise ValueError(f"samples must be at least 1, got {samples}")
        done = done or {}

        async def one(spec: EpisodeSpec, flight: _Flight) -> Rollout:
            if (spec.task_id, spec.index) in done:
                return done[spec.task_id, spec.index]
            rollout = await self._run_rollout(spec, flight)
            if progress is not None:
                progress(rollout)
            return rollout

        results: dict[str, list[Rollout]] = {}
        jobs = []
        for task_id in task_ids:
            flight = _Flight()  # eval groups are never doomed: they are not in `_flights`
            specs = [EpisodeSpec(task_id, self.tasks_dir, f"{task_id}@eval", i,
                                 rollout_seed(self.config.run_seed, task_id, i)) for i in range(samples)]
            jobs.append((task_id, asyncio.gather(*(one(s, flight) for s in specs))))
        done = await asyncio.gather(*(job for _, job in jobs))
        for (task_id, _), rollouts in zip(jobs, done, strict=True):
            results[task_id] = sorted(rollouts, key=lambda r: r.index)
        return results

    # Reporting and shutdown --------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {**{k: self.counters[k] for k in (
                    "started", "finished", "infra_retries", "masked_infra", "requeued", "cancelled",
                    "groups_completed", "zero_variance_groups", "dropped_zero_variance", "kept_zero_variance",
                    "dropped_stale_rollouts", "doomed_groups", "batches", "accepted_rollouts")},
                "infra_by_cause": dict(self.infra_causes), "in_flight": self._in_flight,
                "ready_groups": len(self._ready), **self.gate.stats()}

    def state(self) -> dict:
        """Everything a resumed run needs to go on as this one would, as JSON: the task sampler's random state, the
        groups started per task (the next seeds), the curriculum, the staleness gate, the counters, and the groups
        in play — started, not yet in a batch or dropped — which a resumed scheduler starts again first, with the
        same seeds. Take it between batches (after `update_weights`): what is in flight is re-run, not lost."""
        version, internal, gauss = self._rng.getstate()
        return {"rng": [version, list(internal), gauss], "groups_of": dict(self._groups_of),
                "curriculum": self.curriculum.state(), "gate": self.gate.state(), "counters": dict(self.counters),
                "infra_causes": dict(self.infra_causes), "step": self._step,
                "pending": sorted(self._pending.values(), key=lambda e: e["seq"])}

    def load_state(self, state: dict) -> None:
        """Continue from `state()` (of a scheduler with the same config and tasks); before the first `next_batch`."""
        if self._producer is not None:
            raise RuntimeError("load_state must come before the first next_batch: this scheduler is already running")
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self._groups_of = Counter(state["groups_of"])
        self.curriculum.load_state(state["curriculum"])
        self.gate.load_state(state["gate"])
        self.counters, self.infra_causes = Counter(state["counters"]), Counter(state["infra_causes"])
        self._step = state["step"]
        self._resume = list(state["pending"])

    async def restore_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """After `load_state`: give the engines (fresh, at version 0) the restored policy, labelled with the restored
        trainer version, without counting an update."""
        await self.transport.update_weights(self.gate.version, tensors)

    async def close(self) -> None:
        """Stop starting episodes, cancel those running (they stop at their next check), wait up to
        `close_timeout` for them, then close the transport."""
        if self._closing:
            return
        async with self._cond:
            self._closing = True
            self._cond.notify_all()
        pending = [t for t in (self._producer, *self._tasks) if t is not None and not t.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.config.close_timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await self.transport.close()
