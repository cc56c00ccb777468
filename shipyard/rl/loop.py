"""The RL loop: tasks → rollouts → rewards → trainer → new weights → a better agent.

    curriculum ──sample──▶ Scheduler (groups of N rollouts, async, bounded staleness) ──▶ engines + sandboxes
        ▲                       │   run_episode: agent loop in a sandbox → patch → grade → monitors
        │ pass rates            ▼
        └──────────── RolloutBatch (G groups; shaping → group-relative advantages; stale tokens masked)
                                │   hints(batch) — the targeted-feedback seam: per-turn hint tokens
                                ▼
                      Batch.from_rollouts ──▶ Trainer.step (policy loss + IS correction [+ hint distillation])
                                │
                  engine_weights ▼                                   every `checkpoint_every` steps:
                 Scheduler.update_weights(version) ──▶ engines        checkpoint (trainer + scheduler) + HF export
                                                                     every `eval_every` steps: held-out eval

One step: wait for the next batch (the engines kept generating while the trainer trained, up to `max_staleness`
versions ahead), train on it in a worker thread (so the event loop — and with it the rollouts — keeps running),
push the new weights to the engines, log. Nothing here knows whether the transport is in-process or Ray, or
whether the trainer is one process or many: every trainer call that the other ranks take part in goes through
`TrainerRanks` (`shipyard.rl.ranks`), which at world size 1 just makes it.

**Monitors.** `run_episode` runs the reward-hacking monitors on every rollout and keeps their flags with evidence
in `Rollout.monitor_flags`. The loop counts them per step (`monitor/flagged`), writes the flagged rollouts'
evidence with their trajectories, and with `zero_flagged` the `HackPenalty` shaping term
(`shipyard.rollout.advantages`, given to the scheduler, so it acts before the advantages) takes a flagged rollout's
reward to 0.

**Resuming.** A checkpoint holds the trainer (weights, optimiser, schedules, RNG, version) and the scheduler's
state (sampler RNG, seeds, curriculum, groups in play); `resume` restores both, hands the engines the restored
policy, drops the run directory's logs of later steps (they are redone) and continues from the checkpoint's step.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shipyard.rl.config import RunConfig
from shipyard.rl.hints import HintReport
from shipyard.rl.ranks import TrainerRanks
from shipyard.rl.rundir import RunDir
from shipyard.rollout.batches import RolloutBatch
from shipyard.rollout.episode import WireSettings
from shipyard.rollout.eval import default_ks, results, save_results, validity
from shipyard.rollout.record import Hint
from shipyard.rollout.scheduler import Scheduler
from shipyard.train.batch import Batch
from shipyard.train.checkpoint import latest_checkpoint, load_checkpoint, require_space, save_checkpoint
from shipyard.train.memory import PeakRSS, resident_mb
from shipyard.train.trainer import Trainer

SCHEDULER_STATE = "scheduler.json"


HintSource = Callable[[RolloutBatch], HintReport]  # shipyard.rl.hints.HintWriter


def batch_metrics(batch: RolloutBatch) -> dict[str, Any]:
    """What a batch says about the policy: rewards, pass rate, lengths, parallel width, monitor flags, shaping terms,
    staleness, grounded tool-call validity (`tools/grounded_fraction`: grounded calls / calls,
    `shipyard.harness.validity`), and how busy the sandboxes were (`sandbox/*`, from the rollouts' timings)."""
    rollouts = batch.rollouts
    scored = [r for r in rollouts if r.reward is not None]
    turns = [t for r in rollouts if r.trajectory is not None for t in r.trajectory.turns]
    widths = [t.parallel_width for t in turns if t.parallel_width]
    flags = Counter(f.get("kind", "unknown") for r in rollouts for f in r.monitor_flags)  # monitors.Flag.kind
    seconds = Counter()
    for r in rollouts:
        seconds.update(r.timings)
    total = seconds["total"]
    versions = [v for r in rollouts for v in r.versions if v >= 0]  # -1: a replay engine's, which has no policy
    return {
        "reward": {"mean": sum(r.reward for r in scored) / len(scored) if scored else None,
                   "pass_rate": sum(r.reward >= 1.0 for r in scored) / len(scored) if scored else None,
                   "advantage_abs_mean": sum(abs(a) for a in batch.advantages) / max(len(rollouts), 1)},
        "rollouts": {"accepted": len(rollouts), "masked": batch.masks.count(0), "groups": len(batch.groups)},
        "episode": {"turns_mean": len(turns) / max(len(rollouts), 1),
                    "sampled_tokens": sum(len(t.completion_ids) for t in turns),
                    "parallel_width_mean": sum(widths) / len(widths) if widths else 0.0},
        "monitor": {"flagged": sum(bool(r.monitor_flags) for r in rollouts), **{f"flag_{k}": v for k, v in
                                                                                 flags.items()}},
        # Each shaping term's mean over scored rollouts, and on how many it was not 0 (effort calibration pays only
        # among a group's solutions: `_active` 0 says it has had nothing to act on).
        "shaping": {f"{name}_{stat}": value for name in sorted({n for r in scored for n in r.shaping})
                    for stat, value in (("mean", sum(r.shaping.get(name, 0.0) for r in scored) / len(scored)),
                                        ("active", sum(r.shaping.get(name, 0.0) != 0.0 for r in scored)))},
        "staleness": {"max": max(batch.staleness(), default=0)},
        # The policy versions the engines sampled this batch with (each turn's, from the engine's labels): they
        # advance step by step only when every push reaches the engines.
        "engine": {"policy_version": max(versions, default=None), "oldest_version": min(versions, default=None)},
        "tools": validity(rollouts).as_metrics(prefix=""),
        # Sandbox utilisation: the share of the rollouts' lives their sandboxes spent running tools and tests, and
        # the share spent waiting for the model (the rest: starting sandboxes, the harness itself).
        "sandbox": {"busy_fraction": (seconds["tools"] + seconds["grade"]) / total if total else None,
                    "model_wait_fraction": seconds["generate"] / total if total else None,
                    "tool_seconds": seconds["tools"], "grade_seconds": seconds["grade"],
                    "start_seconds_mean": seconds["sandbox"] / max(len(rollouts), 1)},
    }


def memory_metrics(step_peak: float) -> dict[str, float]:
    """This process's resident memory now, at the step's peak (`step_peak`, sampled over the step: rollouts, hints,
    training, weight sync) and at its peak since it started (MiB); the accelerator's peak when there is one."""
    import resource

    import torch

    rss = resident_mb()
    out = {"rss_mb": rss, "step_peak_rss_mb": max(step_peak, rss),
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    if torch.cuda.is_available():
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def trajectory_records(batch: RolloutBatch, hints: Sequence[Hint]) -> list[dict[str, Any]]:
    """One JSON record per rollout for RUN/trajectories/: the rollout (trajectory, verdict, monitor flags with their
    evidence, advantage) and the hints given for it."""
    by_sample: dict[int, list[dict]] = {}
    for h in hints:
        by_sample.setdefault(h.sample, []).append({"turn": h.turn, "kinds": list(h.kinds), "text": h.text,
                                                   "evidence": list(h.evidence), "hint_ids": list(h.hint_ids)})
    return [{**r.to_json(), "hints": by_sample.get(i, [])} for i, r in enumerate(batch.rollouts)]


def export_policy(trainer: Trainer, full: dict[str, Any], tokenizer, directory: Path,
                  wire: WireSettings = WireSettings()) -> None:
    """The policy (`full`: `Trainer.export_weights()`, with LoRA the adapter merged in) as a Hugging Face model
    directory (config, safetensors weights, tokenizer) that `shipyard serve --model DIR`, transformers and vLLM load;
    written beside `directory` and swapped in, so a reader never sees half an export. Its shipyard.json records the
    version, the step and the wire settings it was trained with (`wire`), which evaluating and serving the directory
    then default to (`shipyard.rollout.episode.wire_defaults`). Rank 0 only."""
    import shutil

    directory = Path(directory)
    partial, old = directory.with_name(f".{directory.name}.partial"), directory.with_name(f".{directory.name}.old")
    for leftover in (partial, old):  # what an export that died left
        shutil.rmtree(leftover, ignore_errors=True)
    # the new export is written beside the old one: its tensors, the tokenizer and configs (~10 MiB; 32 kept)
    require_space(directory.parent, sum(v.nbytes for v in full.values()) + (32 << 20),
                  f"the export of step {trainer.step_count}")
    trainer.model.save_pretrained(partial, state_dict={k: v.contiguous() for k, v in full.items()})
    stored = next(iter(full.values())).dtype
    if trainer.model.dtype != stored:  # transformers records the module's dtype (a LoRA policy's: its frozen base's)
        config = copy.deepcopy(trainer.model.config)
        config.dtype = stored
        config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "shipyard.json").write_text(json.dumps({"policy_version": trainer.version, "step": trainer.step_count,
                                                        "wire": asdict(wire)}) + "\n")
    if directory.exists():
        directory.rename(old)
    partial.rename(directory)
    shutil.rmtree(old, ignore_errors=True)


class RLLoop:
    """Drives `scheduler` and `trainer` (rank 0's, with the other ranks through `TrainerRanks`) for `settings.steps`
    steps, writing everything to `run`. `export(trainer, full_state_dict, directory)` writes the policy for serving;
    `ranks`: the trainer's other ranks (`shipyard.rl.ranks.RankGroup.ranks`; default: none)."""

    def __init__(self, scheduler: Scheduler, trainer: Trainer, run: RunDir, settings: RunConfig, *,
                 eval_tasks: Sequence[str] = (), hints: HintSource | None = None,
                 export: Callable[[Trainer, dict[str, Any], Path], None] | None = None,
                 on_step: Callable[[int, dict[str, Any]], None] | None = None, ranks: TrainerRanks | None = None):
        self.scheduler, self.trainer, self.run, self.settings = scheduler, trainer, run, settings
        self.ranks = ranks or TrainerRanks(trainer)
        self.eval_tasks = list(eval_tasks)
        self.hints = hints
        self.export = export
        self.on_step = on_step
        self.step = 0

    # Resuming -------------------------------------------------------------------------------------------------
    async def resume(self) -> int:
        """Restore trainer and scheduler from the run's latest checkpoint; the step it continues after (0: none)."""
        path = latest_checkpoint(self.run.checkpoints_dir)
        if path is None:
            return 0
        self.ranks(load_checkpoint, path)
        self.scheduler.load_state(json.loads((path / SCHEDULER_STATE).read_text()))
        await self.scheduler.restore_weights(self.ranks(Trainer.engine_weights))
        self.step = self.trainer.step_count
        return self.step

    def checkpoint(self) -> Path:
        path = self.ranks(save_checkpoint, self.run.checkpoints_dir,
                          extra={SCHEDULER_STATE: json.dumps(self.scheduler.state())},
                          keep=self.settings.keep_checkpoints)
        if self.settings.export and self.export is not None:
            self.export(self.trainer, self.ranks(Trainer.export_weights), self.run.export_dir)
        return path

    # Evaluation -----------------------------------------------------------------------------------------------
    async def evaluate(self) -> dict[str, Any] | None:
        """Held-out tasks with the current policy, saved as RUN/eval/step-N.json; its headline figures."""
        if not self.eval_tasks:
            return None
        start = time.monotonic()
        groups = await self.scheduler.evaluate(self.eval_tasks, self.settings.eval_samples)
        ks = default_ks(self.settings.eval_samples)
        doc = results(groups, ks, config={"step": self.step, "policy_version": self.trainer.version},
                      wall_seconds=time.monotonic() - start)
        save_results(doc, self.run.eval_path(self.step))
        overall = doc["overall"]
        return {**{f"pass@{k}": v for k, v in overall["pass_at"].items()},
                **{key: overall[key] for key in ("passed", "scored", "masked", "flagged_rollouts", "reward_mean")},
                "grounded_fraction": overall["validity"]["grounded_fraction"],
                "placeholder_calls": overall["validity"]["placeholder"], "tool_calls": overall["validity"]["calls"],
                "untagged_grounded_calls": overall["validity"]["problems"].get("untagged_ran", 0),
                **{f"mean_{key}": value for key, value in overall["mean"].items()}}

    # The loop ---------------------------------------------------------------------------------------------------
    async def train_step(self) -> dict[str, Any]:
        with PeakRSS() as peak:
            metrics, batch, hints = await self._train_step()
        metrics["memory"] = memory_metrics(peak.peak)
        given = Counter(h.sample for h in hints)  # the dashboard lists hinted rollouts from these lines
        self.run.log_rollouts([{**m, "hints": given[i]} for i, m in enumerate(batch.metrics())])
        self.run.write_trajectories(self.step, trajectory_records(batch, hints))
        return metrics

    async def _train_step(self) -> tuple[dict[str, Any], RolloutBatch, list[Hint]]:
        t0 = time.monotonic()
        batch = await self.scheduler.next_batch()
        waited = time.monotonic() - t0
        # the detectors are cheap, but a critic model is not: off the event loop, so the rollouts go on meanwhile
        report = await asyncio.to_thread(self.hints, batch) if self.hints is not None else HintReport()
        hints = batch.hints = report.hints
        tensors = Batch.from_rollouts(batch, pad_id=self.trainer.pad_id, header_ids=self.trainer.header_ids)
        train = await asyncio.to_thread(self.ranks, Trainer.step, tensors)
        t1 = time.monotonic()
        if not train.get("skipped"):
            await self.scheduler.update_weights(self.trainer.version, self.ranks(Trainer.engine_weights))
        self.step += 1
        stats = self.scheduler.stats()
        seen = batch_metrics(batch)
        metrics = {**seen, "train": train,
                   "time": {"step_seconds": time.monotonic() - t0, "wait_batch_seconds": waited,
                            "weight_sync_seconds": time.monotonic() - t1},
                   "staleness": {**seen["staleness"], "mean": stats["mean_staleness"],
                                 "trained_token_fraction": stats["trained_token_fraction"]},
                   "infra": {"masked": stats["masked_infra"], "retries": stats["infra_retries"],
                             "requeued": stats["requeued"], **{f"cause_{k}": v for k, v in
                                                                stats["infra_by_cause"].items()}},
                   "hints": report.metrics()}
        return metrics, batch, hints

    async def run_loop(self) -> list[dict[str, Any]]:
        """Resume if the run has a checkpoint, evaluate, train to `settings.steps` — or, with `settings.max_minutes`,
        until the next step would not fit: a step is only started if the longest step so far still ends within the
        budget (counted from the loop's start) —, evaluate; the logged lines."""
        lines = []
        deadline = None if self.settings.max_minutes is None else time.monotonic() + 60 * self.settings.max_minutes
        out_of_time = False
        try:
            await self.resume()
            if self.step == 0 and (before := await self.evaluate()) is not None:
                lines.append(self.run.log(0, {"eval": before}))
            longest = 0.0
            while self.step < self.settings.steps:
                started = time.monotonic()
                metrics = await self.train_step()
                longest = max(longest, time.monotonic() - started)
                out_of_time = (deadline is not None and time.monotonic() + longest > deadline
                               and self.step < self.settings.steps)
                last = self.step == self.settings.steps or out_of_time
                if out_of_time:
                    metrics["run"] = {"stopped_at_budget": 1}
                due = last or (self.settings.eval_every and self.step % self.settings.eval_every == 0)
                if due and (after := await self.evaluate()) is not None:
                    metrics["eval"] = after
                lines.append(self.run.log(self.step, metrics))  # before the checkpoint: a resume redoes what it lacks
                if self.step % self.settings.checkpoint_every == 0 or last:
                    self.checkpoint()
                self.run.set_status("running", step=self.step)
                if self.on_step is not None:
                    self.on_step(self.step, lines[-1])
                if out_of_time:
                    break
        except BaseException as e:
            self.run.fail(e, step=self.step)
            raise
        finally:
            await self.scheduler.close()
            self.run.close()
        self.run.set_status("finished", step=self.step, stopped="max_minutes" if out_of_time else None)
        return lines
