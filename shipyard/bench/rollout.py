"""Rollout throughput on a straggler-heavy workload: synchronous batching vs asynchronous + load-balanced.

Both modes drive the real `Scheduler` through a real `Transport` (`SimTransport`) whose episodes are simulated:
each turn generates on a shared simulated engine, then sleeps for the turn's tool time (the sandbox). The workload
is fixed by the seed: rollout i of group k draws its profile from its own seed (`rollout_seed(run seed, task,
k·N + i)`), so both modes run exactly the same episodes, in the same order of groups.

- turns per episode: 1 + Exp(mean 2), at most 8;
- generation per turn, in decode steps: 8 · Pareto(α = 1.3), at most 400 (median ≈ 14, a long tail);
- tool time per turn: 20 ms · Pareto(α = 1.1), at most 2 s (most commands are quick, a few run a slow suite).

Engines have a real cost model: one decode step over a batch of B sequences takes a + b·B seconds (memory-bound
weight reads plus per-sequence work), with at most M sequences per engine; E engines. Weight updates pause an
engine for `update_s`; a trainer step takes `train_s`.

- **sync** (max_staleness 0, the batch's G·N rollouts in flight): static batching in lockstep. Every turn, once
  every unfinished rollout of the batch has asked for its completion, the requests are split round-robin over the
  engines and each engine runs its share as one static batch until its longest completion ends (rows that finished
  early still occupy the batch); then tools; the next turn waits for the slowest tool. After the batch, a trainer
  step, then the weight update.
- **sync-continuous** (max_staleness 0, the batch's G·N rollouts in flight): the synchronous algorithm on the async
  mode's machinery — continuous-batching engines, least-loaded sticky routing — but no generation while the trainer
  trains and the batch waits for its slowest rollout. The stronger synchronous baseline (what a synchronous
  framework on a continuous-batching server does); `ratio_vs_sync_continuous` is measured against it.
- **async** (max_staleness ≥ 1, up to `--workers` rollouts in flight): continuous-batching engines admit new
  sequences as others finish, new rollouts go to the least-loaded engine and stay there (their KV cache), and
  generation continues while the trainer trains.

Throughput is accepted rollouts per second until the last batch is handed to the trainer. The work-conserving
bound is the largest of three lower bounds on that time, from the accepted rollouts' total work and the capacity:
every engine decoding full batches all the time (Σ steps · (a + b·M) / (E·M), plus the weight-update pauses), every
sandbox slot busy with rollouts running at single-sequence speed (Σ (tools + steps · (a + b)) / W), and the
longest single rollout. `bound_fraction` = async throughput / the bound's throughput. Rollouts started but not
accepted by the end (run ahead, or dropped as too stale) are reported, not hidden, and so is the fraction of the
decode steps that went to accepted rollouts ("decoded for accepted"): the rest is the work in flight when the run
stops and, under `--stale-tokens drop`, the price of the staleness bound (stragglers that outlived η updates, cancelled
or dropped whole). Under the default `mask` those stragglers are accepted and only their tokens sampled more than η
versions before their batch are left out of training: `trained_token_fraction` is the share of the accepted rollouts'
sampled tokens that are trained on, and `trained_bound_fraction` the stricter bound fraction that counts only the
decode steps trained on as work (masked stale tokens are then waste too).

The headline figures are steady state — from the first batch handed out to the last, without the pipeline filling
up — and the end-to-end figures (from the start) are in the JSON too. The sync baseline's figures hardly differ
between the two; the async one's first batch waits for the pipeline to fill.

    shipyard bench rollout [-- --steps 24 --scale 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from shipyard.bench._common import finish, table
from shipyard.harness.trajectory import Trajectory, Turn
from shipyard.rollout.record import EpisodeSpec, Rollout
from shipyard.rollout.scheduler import Scheduler, SchedulerConfig
from shipyard.rollout.staleness import STALE_TOKENS
from shipyard.tasks.curriculum import Curriculum, Difficulty

TASK = "straggler"
MODES = ("sync", "sync-continuous", "async")
MAX_STEPS = 400


@dataclass(frozen=True)
class Cost:
    a: float  # seconds per decode step
    b: float  # seconds per sequence in the step
    max_batch: int
    update_s: float

    def step(self, batch: int) -> float:
        return self.a + self.b * batch


@dataclass(frozen=True)
class Profile:
    turns: tuple[tuple[int, float], ...]  # (decode steps, tool seconds) per turn
    reward: float

    @property
    def steps(self) -> int:
        return sum(s for s, _ in self.turns)

    @property
    def tools(self) -> float:
        return sum(t for _, t in self.turns)


def profile(spec: EpisodeSpec, scale: float, max_steps: int) -> Profile:
    rng = random.Random(spec.seed)
    n = min(8, 1 + int(rng.expovariate(1 / 2.0)))
    turns = tuple((min(max_steps, int(8 * rng.paretovariate(1.3))), scale * min(2.0, 0.02 * rng.paretovariate(1.1)))
                  for _ in range(n))
    return Profile(turns, float(spec.index % 2))  # every group has reward variance: no dynamic-sampling drops


# Engines ---------------------------------------------------------------------------------------------------------
@dataclass
class Usage:
    busy_s: float = 0.0
    steps: int = 0
    seq_steps: int = 0  # sequence-steps computed (a static batch counts finished rows still occupying it)
    useful: int = 0  # sequence-steps that produced a token someone asked for


class ContinuousEngine:
    """Continuous batching: every step advances all running sequences by one token; queued ones join as running
    ones finish (at most `max_batch`). Weight updates land between steps."""

    def __init__(self, name: str, cost: Cost, oldest_first: bool = False):
        self.name, self.cost, self.version = name, cost, 0
        self.oldest_first = oldest_first
        self.usage = Usage()
        self._queue: list = []  # a heap of (priority, arrival, steps, future)
        self._order = itertools.count()
        self._running: list[list] = []  # [steps left, future, version at admission]
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._clock = 0.0  # when the last decode step ended, on the simulated device's clock
        self._task = asyncio.create_task(self._loop())

    def load(self) -> int:
        return len(self._queue) + len(self._running)

    async def generate(self, steps: int, priority: int = 0) -> int:
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (priority if self.oldest_first else 0, next(self._order), steps, fut))
        self._wake.set()
        return await fut

    async def update_weights(self, version: int) -> None:
        async with self._lock:
            await asyncio.sleep(self.cost.update_s)
            self.version = version
            self._clock = time.perf_counter()

    async def _loop(self) -> None:
        while True:
            while self._queue and len(self._running) < self.cost.max_batch:
                _, _, steps, fut = heapq.heappop(self._queue)
                self._running.append([steps, fut, self.version])
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                self._clock = time.perf_counter()
                continue
            async with self._lock:
                b = len(self._running)
                t0 = time.perf_counter()
                # the step ends a + b·B after the previous one ended (after now, when the engine was idle): a late
                # wake-up of the event loop shortens the next sleep instead of slowing the simulated GPU down
                self._clock += self.cost.step(b)
                await asyncio.sleep(max(0.0, self._clock - t0))
                self.usage.busy_s += time.perf_counter() - t0
                self.usage.steps += 1
                self.usage.seq_steps += b
                self.usage.useful += b
                for seq in self._running:
                    seq[0] -= 1
                done = [s for s in self._running if s[0] <= 0]
                self._running = [s for s in self._running if s[0] > 0]
                for _, fut, version in done:
                    fut.set_result(version)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class LockstepEngines:
    """Static batching in lockstep over E engines: a turn's requests go out together once every unfinished rollout
    of the cohort (the batch being generated) has asked; each engine's share runs until its longest row ends."""

    def __init__(self, engines: int, cost: Cost, cohort: int):
        self.cost, self.cohort = cost, cohort
        self.version = 0
        self.usage = [Usage() for _ in range(engines)]
        self._remaining = cohort
        self._waiting: list[tuple[int, asyncio.Future]] = []
        self._batches: set[asyncio.Task] = set()

    async def generate(self, steps: int, priority: int = 0) -> int:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((steps, fut))
        self._maybe_fire()
        return await fut

    def episode_done(self) -> None:
        self._remaining -= 1
        if self._remaining == 0:
            self._remaining = self.cohort
        self._maybe_fire()

    def _maybe_fire(self) -> None:
        if self._waiting and len(self._waiting) == self._remaining:
            waiting, self._waiting = self._waiting, []
            shares = [waiting[e::len(self.usage)] for e in range(len(self.usage))]
            for usage, share in zip(self.usage, shares, strict=True):
                if share:
                    task = asyncio.create_task(self._static(usage, share, self.version))
                    self._batches.add(task)
                    task.add_done_callback(self._batches.discard)

    async def _static(self, usage: Usage, share: list, version: int) -> None:
        for i in range(0, len(share), self.cost.max_batch):  # more rows than fit: one static batch after another
            rows = share[i:i + self.cost.max_batch]
            longest = max(s for s, _ in rows)
            t0 = time.perf_counter()
            await asyncio.sleep(longest * self.cost.step(len(rows)))
            usage.busy_s += time.perf_counter() - t0
            usage.steps += longest
            usage.seq_steps += longest * len(rows)
            usage.useful += sum(s for s, _ in rows)
            for _, fut in rows:
                fut.set_result(version)

    async def update_weights(self, version: int) -> None:
        await asyncio.sleep(self.cost.update_s)  # engines are idle between lockstep batches
        self.version = version


# The transport ---------------------------------------------------------------------------------------------------
@dataclass
class SimTransport:
    """Runs simulated episodes: per turn, generation on an engine, then the tool time in a 'sandbox' (a sleep)."""

    mode: str  # "sync" | "sync-continuous" | "async"
    cost: Cost
    engines: int
    workers: int
    scale: float
    max_steps: int
    cohort: int = 0
    oldest_first: bool = False
    profiles: dict[str, Profile] = field(default_factory=dict)  # rollout id -> what it ran
    decoded: dict[str, int] = field(default_factory=dict)  # rollout id -> decode steps it was given so far
    sandbox_busy_s: float = 0.0

    def __post_init__(self) -> None:
        self.lockstep_mode = self.mode == "sync"
        if self.lockstep_mode:
            self.lockstep = LockstepEngines(self.engines, self.cost, self.cohort)
        else:
            self.pool = [ContinuousEngine(f"engine{i}", self.cost, self.oldest_first) for i in range(self.engines)]
        self._sticky: dict[str, ContinuousEngine] = {}

    def _route(self, session: str) -> Callable:
        if self.lockstep_mode:
            return self.lockstep.generate
        engine = self._sticky.get(session)
        if engine is None:
            engine = self._sticky[session] = min(self.pool, key=ContinuousEngine.load)
        return engine.generate

    async def run(self, spec: EpisodeSpec, cancelled: Callable[[], bool]) -> Rollout:
        prof = profile(spec, self.scale, self.max_steps)
        self.profiles[spec.rollout_id] = prof
        traj = Trajectory(task=spec.task_id, model="sim", prompt_ids=[0])
        generate = self._route(spec.rollout_id)
        try:
            for i, (steps, tool_s) in enumerate(prof.turns):
                if cancelled():
                    return Rollout(spec.task_id, spec.group_id, spec.index, spec.seed, "cancelled", None,
                                   trajectory=traj, stop_reason="cancelled", engine="sim")
                version = await generate(steps, int(spec.group_id.rsplit("@", 1)[1]))
                self.decoded[spec.rollout_id] = self.decoded.get(spec.rollout_id, 0) + steps
                traj.turns.append(Turn(i, "", [0] * steps, [0.0] * steps, "stop", [], [], 1, 0.0, tool_s, version))
                t0 = time.perf_counter()
                await asyncio.sleep(tool_s)
                self.sandbox_busy_s += time.perf_counter() - t0
        finally:
            self._sticky.pop(spec.rollout_id, None)
            if self.lockstep_mode:
                self.lockstep.episode_done()
        return Rollout(spec.task_id, spec.group_id, spec.index, spec.seed, "graded", prof.reward, trajectory=traj,
                       stop_reason="finished", engine="sim")

    async def update_weights(self, version: int, tensors) -> None:
        if self.lockstep_mode:
            await self.lockstep.update_weights(version)
        else:
            await asyncio.gather(*(e.update_weights(version) for e in self.pool))

    def capacity(self) -> int:
        return self.workers

    def usage(self) -> list[Usage]:
        return self.lockstep.usage if self.lockstep_mode else [e.usage for e in self.pool]

    async def close(self) -> None:
        if not self.lockstep_mode:
            await asyncio.gather(*(e.close() for e in self.pool))


# Runs ------------------------------------------------------------------------------------------------------------
@dataclass
class Result:
    mode: str
    marks: list[float]  # seconds from the start until each batch was handed to the trainer
    batches: list[list[Rollout]]
    min_versions: list[int]  # per batch: tokens sampled by an older version were not trained on
    transport: SimTransport
    stats: dict
    usage: list[Usage]
    sandbox_s: float

    def window(self, steady: bool) -> tuple[list[Rollout], float]:
        """The accepted rollouts and the seconds they took: end to end (from the start to the last batch), or in
        steady state (from the first batch to the last: without the pipeline filling up)."""
        if steady:
            return [r for b in self.batches[1:] for r in b], self.marks[-1] - self.marks[0]
        return [r for b in self.batches for r in b], self.marks[-1]

    def rate(self, steady: bool) -> float:
        rollouts, seconds = self.window(steady)
        return len(rollouts) / seconds


async def run_mode(mode: str, args, cost: Cost) -> Result:
    batch = args.groups * args.group_size
    synchronous = mode.startswith("sync")
    workers = batch if synchronous else args.workers
    transport = SimTransport(mode, cost, args.engines, workers, args.scale, args.max_steps, cohort=batch,
                             oldest_first=args.oldest_first)
    config = SchedulerConfig(group_size=args.group_size, groups_per_step=args.groups, run_seed=args.seed,
                             max_staleness=0 if synchronous else args.max_staleness, max_in_flight=workers,
                             stale_tokens=args.stale_tokens)
    sched = Scheduler(config, transport, Path("/sim"), Curriculum({TASK: Difficulty(1, 1, 1, 1)}))
    marks, batches, min_versions = [], [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        got = await sched.next_batch()
        marks.append(time.perf_counter() - t0)
        batches.append(got.rollouts)
        min_versions.append(got.min_version)
        if step == args.steps - 1:
            break
        await asyncio.sleep(args.train_s)  # the trainer step (async: the engines keep generating meanwhile)
        await sched.update_weights(step + 1, {})
    stats = sched.stats()
    usage = [replace(u) for u in transport.usage()]  # as of the last batch; the close below cancels the rest
    sandbox_s = transport.sandbox_busy_s
    await sched.close()
    return Result(mode, marks, batches, min_versions, transport, stats, usage, sandbox_s)


def trained_steps(res: Result, steady: bool) -> int:
    """Decode steps of the accepted rollouts' turns that were trained on (not masked as older than η)."""
    first = 1 if steady else 0
    return sum(len(t.completion_ids) for batch, floor in zip(res.batches[first:], res.min_versions[first:], strict=True)
               for r in batch for t in r.trajectory.turns if t.policy_version >= floor)


def bound_seconds(res: Result, cost: Cost, engines: int, steady: bool, trained: bool = False) -> dict[str, float]:
    """The work-conserving bound on the window's time for its accepted rollouts; with `trained`, for the decode
    steps trained on only (a stricter count: masked stale tokens and unaccepted work both count as waste)."""
    rollouts, _ = res.window(steady)
    profs = [res.transport.profiles[r.rollout_id] for r in rollouts]
    updates = len(res.batches) - (2 if steady else 1)
    steps = trained_steps(res, steady) if trained else sum(p.steps for p in profs)
    gen = steps * cost.step(cost.max_batch) / (engines * cost.max_batch) + updates * cost.update_s
    slots = sum(p.tools + p.steps * cost.step(1) for p in profs) / res.transport.workers
    longest = 0.0 if steady else max(p.tools + p.steps * cost.step(1) for p in profs)
    return {"engines_s": gen, "sandboxes_s": slots, "longest_s": longest, "bound_s": max(gen, slots, longest)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24, help="trainer steps (batches) per mode")
    ap.add_argument("--groups", type=int, default=8, help="groups per batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=16, help="sequences per engine at once")
    ap.add_argument("--workers", type=int, default=96, help="async: rollouts in flight (sandbox slots)")
    ap.add_argument("--max-staleness", type=int, default=8)
    ap.add_argument("--a", type=float, default=0.006, help="seconds per decode step")
    ap.add_argument("--b", type=float, default=0.0004, help="seconds per sequence per decode step")
    ap.add_argument("--update-s", type=float, default=0.02, help="weight update pause")
    ap.add_argument("--train-s", type=float, default=0.3, help="trainer step")
    ap.add_argument("--max-steps", type=int, default=MAX_STEPS, help="longest generation of a turn, in steps")
    ap.add_argument("--scale", type=float, default=0.2, help="time scale: a, b, update, train and tool times are "
                    "multiplied by it (the ratio and bound fraction do not depend on it, down to sleep resolution)")
    ap.add_argument("--stale-tokens", choices=STALE_TOKENS, default=SchedulerConfig.stale_tokens,
                    help="what becomes of a straggler's tokens older than η versions (see rollout/staleness.py)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oldest-first", action="store_true", help="async engines admit the oldest group's requests "
                    "first (a priority queue) instead of in arrival order")
    args = ap.parse_args()
    cost = Cost(args.a * args.scale, args.b * args.scale, args.max_batch, args.update_s * args.scale)
    args.train_s *= args.scale

    results = {mode: asyncio.run(run_mode(mode, args, cost)) for mode in args.modes}
    rows, bound_rows, figures = [], [], {}
    for mode, res in results.items():
        usage = res.usage
        seconds = res.marks[-1]
        busy = sum(u.busy_s for u in usage) / len(usage)
        seq_steps, useful, steps = (sum(getattr(u, k) for u in usage) for k in ("seq_steps", "useful", "steps"))
        rollouts, _ = res.window(False)
        work = sum(res.transport.profiles[r.rollout_id].steps for r in rollouts) / len(rollouts)
        figures[(mode, "accepted_work")] = work * len(rollouts) / max(useful, 1)
        rows.append([mode, len(rollouts), seconds, res.rate(False), res.rate(True), busy / seconds,
                     seq_steps / max(steps, 1), useful / max(seq_steps, 1), figures[(mode, "accepted_work")],
                     res.sandbox_s / (res.transport.workers * seconds), work,
                     res.stats["started"] - len(rollouts), res.stats["max_observed_staleness"]])
        for steady in (False, True):
            b = bound_seconds(res, cost, args.engines, steady)
            measured = res.window(steady)[1]
            trained = bound_seconds(res, cost, args.engines, steady, trained=True)["bound_s"] / measured
            bound_rows.append([mode, "steady" if steady else "end to end", b["engines_s"], b["sandboxes_s"],
                               b["longest_s"], b["bound_s"], measured, b["bound_s"] / measured, trained])
            figures[(mode, steady)] = (res.rate(steady), b["bound_s"] / measured)
            figures[(mode, steady, "trained")] = trained
    table("rollout throughput (simulated engines, real scheduler)",
          ["mode", "rollouts", "seconds", "rollouts/s", "steady rollouts/s", "engine busy", "mean batch",
           "useful rows", "decoded for accepted", "sandbox busy", "steps/rollout", "started, not accepted",
           "max staleness"], rows)
    table("work-conserving bound (accepted work / capacity)",
          ["mode", "window", "engines s", "sandboxes s", "longest s", "bound s", "measured s", "fraction",
           "fraction (trained tokens)"],
          bound_rows)
    if not {"sync", "async"} <= set(results):
        return
    a = results["async"]

    def summary(steady: bool) -> dict:
        (s_rate, s_frac), (a_rate, a_frac) = figures[("sync", steady)], figures[("async", steady)]
        return {"sync_rollouts_per_s": round(s_rate, 3), "async_rollouts_per_s": round(a_rate, 3),
                "ratio": round(a_rate / s_rate, 3), "bound_fraction": round(a_frac, 3),
                "trained_bound_fraction": round(figures[("async", steady, "trained")], 3),
                "sync_bound_fraction": round(s_frac, 3),
                **({"sync_continuous_rollouts_per_s": round(figures[("sync-continuous", steady)][0], 3),
                    "ratio_vs_sync_continuous": round(a_rate / figures[("sync-continuous", steady)][0], 3)}
                   if "sync-continuous" in results else {})}

    finish("rollout", {
        **summary(steady=True), "window": "steady state: from the first batch to the last",
        "end_to_end": summary(steady=False),
        "staleness": {k: a.stats[k] for k in ("max_staleness", "mean_staleness", "max_observed_staleness",
                                              "staleness_histogram", "dropped_stale_groups", "stale_tokens",
                                              "trained_token_fraction", "masked_stale_tokens")},
        "started_not_accepted": a.stats["started"] - len(a.window(False)[0]),
        "async_decoded_for_accepted": round(figures[("async", "accepted_work")], 3),
        "async_stats": {k: a.stats[k] for k in ("doomed_groups", "dropped_stale_rollouts", "cancelled")},
        "workload": {"steps": args.steps, "groups": args.groups, "group_size": args.group_size,
                     "engines": args.engines, "max_batch": args.max_batch, "async_workers": args.workers,
                     "a": args.a, "b": args.b, "update_s": args.update_s, "train_s": args.train_s / args.scale,
                     "scale": args.scale, "max_steps": args.max_steps, "seed": args.seed,
                     "stale_tokens": args.stale_tokens}})


if __name__ == "__main__":
    main()
