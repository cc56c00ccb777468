"""`shipyard bench rollout_model`: rollout throughput with a real model, real sandboxes and real grading.

`shipyard bench rollout` measures the scheduler's asynchrony on simulated engines and sandboxes; this one runs the
whole stack as a training run would, minus the trainer: the real `Scheduler` (groups from the curriculum, per-rollout
seeds, bounded staleness) drives the real `InProcessTransport`, whose episode threads share one continuous-batching
`LocalEngine` (a bundled model by default) and one `LocalEnvironment` (bubblewrap sandboxes over each task's
snapshot, the task's own test suite as grader). The trainer's place is taken by a version push between batches: after
each batch the engine gets `update_weights(step, {})` — the weights stay as they are, but the version advances (so the
staleness gate admits the next groups, exactly as in training) and the engine drops its kept KV caches, as after a
real update. `--mode eval` runs `Scheduler.evaluate` instead (one group per task, no updates).

Figures, over the measured window (from the scheduler's start — model loading and task synthesis excluded, each
task's first snapshot included — until the last batch is handed out, or until `evaluate` returns):

- **rollouts/hour**: episodes that came back in the window (any status, each attempt of a retried one: a training
  run pays for every one), and
  **accepted/hour**, those handed to the trainer in batches;
- **tokens/s**: tokens sampled by the engine for those episodes (their turns' completion ids) per second;
- **engine busy**: the fraction of the window the model spent in forward passes (timed by hooks on the model; the
  engine thread's sampling and bookkeeping between passes are not counted);
- **sandbox utilisation**: Σ over the episodes of (seconds their sandboxes spent executing the turns' tool calls +
  grading) / (window × worker slots). Sandbox start and teardown are reported beside it, not in it. Episodes still
  running when the window ends are not counted, so both token and sandbox figures are lower bounds.

An untrained small model solves almost nothing, so every group has zero reward variance: dynamic sampling would
drop and refill every group and the run would measure refills. It is off by default here (`--dynamic-sampling` turns
it on); the figure is throughput, not quality.

    shipyard bench rollout_model [-- --model smollm2-135m --tasks DIR --group-size 4 --groups 2 --workers 4 --steps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

from shipyard.bench._common import finish, table
from shipyard.rollout.demo import EXAMPLE_REPO
from shipyard.rollout.record import EpisodeSpec, Rollout, append_jsonl


class ForwardTimer:
    """Seconds the model spends in forward passes, from hooks on its top module (the engine's thread is the only
    caller, but the count is guarded anyway)."""

    def __init__(self, model) -> None:
        self.seconds, self.passes = 0.0, 0
        self._start = threading.local()
        self._lock = threading.Lock()
        self._handles = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

    def _before(self, module, args) -> None:
        self._start.t = time.perf_counter()

    def _after(self, module, args, output) -> None:
        elapsed = time.perf_counter() - self._start.t
        with self._lock:
            self.seconds += elapsed
            self.passes += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class MeteredTransport:
    """A `Transport` that runs every episode on `inner` and keeps each record with the time it came back."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.returned: list[tuple[float, Rollout]] = []

    async def run(self, spec: EpisodeSpec, cancelled: Callable[[], bool]) -> Rollout:
        rollout = await self.inner.run(spec, cancelled)
        self.returned.append((time.monotonic(), rollout))
        return rollout

    async def update_weights(self, version: int, tensors: Mapping) -> None:
        await self.inner.update_weights(version, tensors)

    def capacity(self) -> int:
        return self.inner.capacity()

    async def close(self) -> None:
        await self.inner.close()


def synthesize(out: Path, max_tasks: int) -> Path:
    """A task set from the example repository (feature deletion, validated with gold patches)."""
    from shipyard.tasks.synth import SynthConfig, Synthesizer

    repo = out / "src" / "pocketlib"
    shutil.copytree(EXAMPLE_REPO, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache", ".ruff_cache",
                                                                    ".benchmarks", ".venv"))
    tasks = out / "tasks"
    report = Synthesizer(repo, tasks, SynthConfig(max_tasks=max_tasks), log=lambda m: print(f"synth: {m}",
                                                                                            file=sys.stderr)).run()
    if not report.accepted:
        raise SystemExit(f"synthesis from {EXAMPLE_REPO} accepted no task ({dict(report.rejections)}); "
                         "pass --tasks DIR")
    return tasks


async def drive(args, transport: MeteredTransport, tasks_dir: Path, task_ids: list[str],
                at_end: Callable[[], dict]) -> dict:
    """Run the scheduler; return the window's start and end, the accepted rollouts, the scheduler's stats and what
    `at_end` returns when the window closes (before `close` cancels the episodes still running)."""
    from shipyard.rollout.scheduler import Scheduler, SchedulerConfig

    config = SchedulerConfig(group_size=args.group_size, groups_per_step=args.groups, max_staleness=args.max_staleness,
                             run_seed=args.seed, dynamic_sampling=args.dynamic_sampling,
                             max_infra_retries=args.max_infra_retries, rollout_time_budget=args.rollout_budget)
    sched = Scheduler(config, transport, tasks_dir)
    accepted: list[Rollout] = []
    marks: list[float] = []
    start = time.monotonic()
    limit = args.max_seconds

    def left() -> float | None:
        return None if limit is None else max(0.0, limit - (time.monotonic() - start))

    stopped_early = False
    try:
        if args.mode == "train":
            for step in range(args.steps):
                try:
                    batch = await asyncio.wait_for(sched.next_batch(), left())
                except TimeoutError:
                    stopped_early = True
                    break
                marks.append(time.monotonic() - start)
                accepted += batch.rollouts
                print(f"batch {step + 1}/{args.steps} at {marks[-1]:.0f} s: {len(batch.rollouts)} rollouts, "
                      f"statuses {dict(Counter(r.status for r in batch.rollouts))}", file=sys.stderr)
                if step < args.steps - 1:
                    await sched.update_weights(step + 1, {})  # no trainer: the version advances, weights unchanged
        else:
            try:
                groups = await asyncio.wait_for(sched.evaluate(task_ids, args.group_size), left())
                accepted = [r for rollouts in groups.values() for r in rollouts]
            except TimeoutError:
                stopped_early = True
        end = time.monotonic()
        stats, measured = sched.stats(), at_end()
    finally:
        await sched.close()
    if stopped_early:
        print(f"--max-seconds {limit}: the window ends after {end - start:.0f} s, with {len(accepted)} rollouts "
              "accepted", file=sys.stderr)
    return {"start": start, "end": end, "accepted": accepted, "marks": marks, "stats": stats,
            "stopped_early": stopped_early, **measured}


def figures(run: dict, returned: list[tuple[float, Rollout]], workers: int) -> dict:
    wall = run["end"] - run["start"]
    done = [r for t, r in returned if t <= run["end"]]
    sampled = sum(len(t.completion_ids) for r in done if r.trajectory for t in r.trajectory.turns)
    busy = {k: sum(r.timings.get(k, 0.0) for r in done) for k in ("tools", "grade", "sandbox", "generate", "total")}
    turns = [len(r.trajectory.turns) for r in done if r.trajectory is not None]
    out = {
        "rollouts": len(done), "accepted": len(run["accepted"]), "wall_s": round(wall, 2),
        "rollouts_per_hour": round(len(done) / wall * 3600, 1),
        "accepted_per_hour": round(len(run["accepted"]) / wall * 3600, 1),
        "sampled_tokens": sampled, "tokens_per_s": round(sampled / wall, 2),
        "sandbox_utilisation": round((busy["tools"] + busy["grade"]) / (wall * workers), 4),
        "sandbox_setup_fraction": round(busy["sandbox"] / (wall * workers), 4),
        "mean_turns": round(sum(turns) / len(turns), 2) if turns else 0.0,
        "statuses": dict(Counter(r.status for r in done)),
        "stop_reasons": dict(Counter(r.stop_reason for r in done)),
        "passed": sum(r.reward == 1.0 for r in done),
        "mean_seconds": {k: round(v / max(len(done), 1), 2) for k, v in busy.items()},
        "infra": {k: run["stats"][k] for k in ("infra_retries", "masked_infra", "requeued", "cancelled")}
        | {"by_cause": run["stats"]["infra_by_cause"]},
        "staleness_histogram": run["stats"]["staleness_histogram"],
        "trained_token_fraction": round(run["stats"]["trained_token_fraction"], 4),
        "batch_marks_s": [round(m, 2) for m in run["marks"]],  # train: when each batch was handed out
        "stopped_early": run["stopped_early"],  # --max-seconds ended the window before the last batch
    }
    out["engine_busy"] = round(run["forward_s"] / wall, 4)
    out["engine"] = {**run["engine_stats"], "forward_passes": run["forward_passes"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tasks", type=Path, help="task set directory (default: synthesize one from examples/pocketlib)")
    ap.add_argument("--max-tasks", type=int, default=3, help="tasks to synthesize when --tasks is not given")
    ap.add_argument("--mode", choices=["train", "eval"], default="train",
                    help="train: Scheduler.next_batch with version pushes between batches; eval: Scheduler.evaluate")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2, help="groups per batch (train)")
    ap.add_argument("--steps", type=int, default=2, help="batches (train)")
    ap.add_argument("--workers", type=int, default=4, help="episodes at once (sandbox slots)")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--grade-timeout", type=float, default=300.0)
    ap.add_argument("--rollout-budget", type=float, default=None, help="seconds per rollout attempt")
    ap.add_argument("--max-infra-retries", type=int, default=2)
    ap.add_argument("--dynamic-sampling", action="store_true", help="drop and refill zero-variance groups")
    ap.add_argument("--max-batch", type=int, default=16, help="sequences the engine decodes together")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=None, help="end the window after this many seconds even "
                    "if batches are missing (figures over what came back by then)")
    ap.add_argument("--out", type=Path, help="append each rollout's metrics here (JSON lines)")
    args = ap.parse_args()

    from shipyard.sandbox.run import sandbox_problem

    problem = sandbox_problem()
    if problem:
        raise SystemExit(f"this host cannot start bubblewrap sandboxes: {problem}")
    from shipyard.tasks.taskset import TaskFormatError, list_tasks

    with tempfile.TemporaryDirectory(prefix="shipyard-bench-rollout-") as tmp:
        if args.tasks is None:
            t0 = time.monotonic()
            tasks_dir = synthesize(Path(tmp), args.max_tasks)
            print(f"synthesized {len(list_tasks(tasks_dir))} tasks in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        else:
            tasks_dir = args.tasks
            if not tasks_dir.is_dir():
                raise SystemExit(f"--tasks {tasks_dir} is not a directory")
        try:
            task_ids = list_tasks(tasks_dir)
        except TaskFormatError as e:
            raise SystemExit(f"rollout_model: {e}") from e
        if not task_ids:
            raise SystemExit(f"{tasks_dir} holds no tasks")
        run_bench(args, tasks_dir, task_ids)


def run_bench(args, tasks_dir: Path, task_ids: list[str]) -> None:
    from shipyard.models.errors import InfraError
    from shipyard.models.local import LocalEngine
    from shipyard.models.resolve import load_hf
    from shipyard.rollout.environment import LocalEnvironment
    from shipyard.rollout.episode import episode_config
    from shipyard.rollout.transport import InProcessTransport

    t0 = time.monotonic()
    model, tok = load_hf(args.model, device=args.device)
    engine = LocalEngine(model, tok, name=args.model, max_batch=args.max_batch)
    print(f"loaded {args.model} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    episode = episode_config(args.model, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, grade_timeout=args.grade_timeout)
    timer = ForwardTimer(engine.model)
    env = LocalEnvironment()
    transport = MeteredTransport(InProcessTransport(engine, env, episode, workers=args.workers))
    before = dict(engine.stats)

    def at_end() -> dict:  # the engine's figures over the window
        return {"forward_s": timer.seconds, "forward_passes": timer.passes,
                "engine_stats": {k: v if k == "max_running" else v - before[k] for k, v in engine.stats.items()}}

    try:
        run = asyncio.run(drive(args, transport, tasks_dir, task_ids, at_end))
    except InfraError as e:  # every rollout of a batch failed: say why, not a traceback
        raise SystemExit(f"rollout_model: {e}") from e
    finally:
        timer.close()
        env.close()
        engine.close()
    fig = figures(run, transport.returned, args.workers)
    engine_stats = fig["engine"]
    if args.out is not None:
        append_jsonl(args.out, [r.metrics() for _, r in transport.returned])
    table(f"rollout throughput — {args.model}, {len(task_ids)} tasks, {args.mode}, {args.workers} workers",
          ["figure", "value"],
          [["rollouts back in the window", fig["rollouts"]], ["accepted in batches", fig["accepted"]],
           ["window (s)", fig["wall_s"]], ["rollouts / hour", fig["rollouts_per_hour"]],
           ["accepted / hour", fig["accepted_per_hour"]], ["sampled tokens", fig["sampled_tokens"]],
           ["sampled tokens / s", fig["tokens_per_s"]], ["engine busy (forward passes)", fig["engine_busy"]],
           ["sandbox utilisation (tools + grading)", fig["sandbox_utilisation"]],
           ["sandbox start + teardown (same units)", fig["sandbox_setup_fraction"]],
           ["mean turns", fig["mean_turns"]], ["passed", fig["passed"]]])
    ms = fig["mean_seconds"]
    table("seconds per rollout (mean)", ["sandbox setup", "generate", "tools", "grade", "total"],
          [[ms["sandbox"], ms["generate"], ms["tools"], ms["grade"], ms["total"]]])
    table("outcomes", ["status", "rollouts"], [[k, v] for k, v in sorted(fig["statuses"].items())])
    table("infrastructure", ["retries", "masked", "requeued", "cancelled", "by cause"],
          [[fig["infra"]["infra_retries"], fig["infra"]["masked_infra"], fig["infra"]["requeued"],
            fig["infra"]["cancelled"], fig["infra"]["by_cause"] or "-"]])
    table("engine counters (window)", ["counter", "value"], [[k, v] for k, v in engine_stats.items()])
    finish("rollout_model", {
        **fig, "model": args.model, "tasks": len(task_ids),
        "config": {"mode": args.mode, "group_size": args.group_size, "groups": args.groups, "steps": args.steps,
                   "workers": args.workers, "max_staleness": args.max_staleness, "max_turns": args.max_turns,
                   "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                   "dynamic_sampling": args.dynamic_sampling, "max_batch": args.max_batch, "seed": args.seed,
                   "device": args.device, "max_seconds": args.max_seconds}})


if __name__ == "__main__":
    main()
