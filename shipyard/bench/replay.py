"""`shipyard bench replay`: the trainer's memory and time on a run's recorded steps, without rollouts.

A run directory keeps each step's rollouts (RUN/trajectories/step-N.jsonl: trajectories, advantages, masks, hints)
and its resolved configuration (RUN/config.toml). This replays those batches in order through a `Trainer` built as
`shipyard train` builds it (the run's model in float32, with LoRA its base in the compute dtype; its trainer
configuration; command-line overrides after the options, e.g. `--trainer.micro_batch_tokens 2048`, to see what a
setting buys) and measures per step the process's peak resident memory (`PeakRSS`: sampled every 5 ms), resident
memory after the step, forward tokens and seconds.

What is not the run's: the weights move as the replayed steps train them (the recorded advantages were computed for
the run's policy) and staleness masking is not replayed (every sampled token is trained) — neither changes a
batch's shapes, which are what memory and time follow. The process holds the trainer alone: a run's own figures
(`memory/peak_rss_mb`) also count its in-process inference engine and the evaluation.

Target (issue 15): memory flat across steps — the peak of every step within 10% of step 2's (`peak_ratio` = the
highest peak after the second replayed step / the second's; `met`). The first step is not the reference: the
optimizer's state is made in it. A step replayed again at the end (`--steps 1-20,2`) shows whether a step's peak
depends on the steps before it.

    shipyard bench replay -- --run RUN [--steps 1-20] [--trainer.micro_batch_tokens 2048 …]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import time
from pathlib import Path

from rich.progress import Progress, TimeElapsedColumn

from shipyard.bench._common import console, finish, table
from shipyard.harness.tools import default_tools
from shipyard.harness.wire import ChatFormat
from shipyard.models.resolve import load_hf
from shipyard.rl.build import trainer_config
from shipyard.rl.config import ConfigError, load_config
from shipyard.rollout.batches import RolloutBatch, RolloutGroup
from shipyard.rollout.record import Hint, Rollout
from shipyard.train.batch import Batch
from shipyard.train.memory import PeakRSS, resident_mb
from shipyard.train.trainer import Trainer

TARGET = 1.10


def step_numbers(run: Path, spec: str | None) -> list[int]:
    recorded = sorted(int(p.stem.split("-")[1]) for p in (run / "trajectories").glob("step-*.jsonl"))
    if not recorded:
        raise SystemExit(f"{run}/trajectories holds no step-*.jsonl: give a run directory of `shipyard train`")
    if spec is None:
        return recorded
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", spec):
        raise SystemExit(f"--steps {spec!r}: give steps and ranges, e.g. 1-20 or 1-20,2")
    want = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        if int(last or first) < int(first):
            raise SystemExit(f"--steps {spec!r}: the range {part} runs backwards")
        want += range(int(first), int(last or first) + 1)
    missing = sorted({s for s in want if s not in recorded})
    if missing:
        raise SystemExit(f"steps {missing} are not recorded in {run}/trajectories (recorded: {recorded[0]}-"
                         f"{recorded[-1]})")
    return want


def recorded_batch(path: Path, pad_id: int, header: tuple[int, ...], hints: bool) -> Batch:
    """A step's rollouts as the loop hands them to the trainer (`Batch.from_rollouts`: masked rollouts count for
    nothing), hints as they were given (`hints`)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rollouts = [Rollout.from_json({k: v for k, v in row.items() if k != "hints"}) for row in rows]
    given = [Hint(i, h["turn"], tuple(h["hint_ids"]), tuple(h["kinds"]), h["text"], tuple(h["evidence"]))
             for i, row in enumerate(rows) for h in row.get("hints", [])] if hints else []
    # the step's groups as one: from_rollouts reads only the rollouts, their masks and advantages, and the hints
    batch = RolloutBatch([RolloutGroup(path.stem, path.stem, rollouts)], hints=given)
    return Batch.from_rollouts(batch, pad_id=pad_id, header_ids=header)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, required=True, help="a `shipyard train` / `shipyard demo` run directory")
    ap.add_argument("--steps", help="recorded steps to replay in this order, e.g. 1-20,2 (a step again at the end: "
                                    "does its peak depend on the steps before it?); default: all")
    args, overrides = ap.parse_known_args()
    if not (args.run / "config.toml").is_file():
        raise SystemExit(f"{args.run}/config.toml is missing: give a run directory of `shipyard train`")
    try:
        config = load_config(args.run / "config.toml", overrides)
        train_config = trainer_config(config)  # as `shipyard train` builds it
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    steps = step_numbers(args.run, args.steps)
    model, tokenizer = load_hf(config.model.name, dtype=train_config.load_dtype)  # float32; with LoRA the base's
    header = tuple(ChatFormat(tokenizer, default_tools()).assistant_header_ids())
    trainer = Trainer(model, train_config, pad_id=tokenizer.pad_token_id, header_ids=header)
    del model
    gc.collect()
    rows = []
    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console) as progress:
        bar = progress.add_task("replaying recorded steps", total=len(steps))
        for step in steps:
            batch = recorded_batch(args.run / "trajectories" / f"step-{step:06d}.jsonl", tokenizer.pad_token_id,
                                   header, config.hints.enabled)
            start = time.perf_counter()
            with PeakRSS() as peak:
                metrics = trainer.step(batch)
            seconds = time.perf_counter() - start
            rows.append([step, int(metrics.get("forward_tokens", 0)), int(metrics.get("tokens", 0)),
                         round(seconds, 1), round(peak.peak), round(resident_mb())])
            progress.console.print(f"step {step}: peak {peak.peak:.0f} MiB, {seconds:.1f} s")
            progress.advance(bar)
    table(f"replay of {args.run}", ["step", "forward tokens", "trained tokens", "seconds", "peak RSS MiB",
                                    "RSS after MiB"], rows)
    peaks = [r[4] for r in rows]
    reference = peaks[1] if len(peaks) > 1 else None  # the second replayed step: the optimizer state exists
    later = peaks[2:]
    ratio = round(max(later) / reference, 3) if reference and later else None
    finish("replay", {"run": str(args.run), "overrides": overrides, "steps": steps,
                      "peak_mb": peaks, "rss_after_mb": [r[5] for r in rows],
                      "forward_tokens": [r[1] for r in rows], "seconds": [r[3] for r in rows],
                      "peak_second_mb": reference,
                      "peak_max_mb": max(peaks), "peak_ratio": ratio, "target_ratio": TARGET,
                      "met": None if ratio is None else ratio <= TARGET})


if __name__ == "__main__":
    main()
