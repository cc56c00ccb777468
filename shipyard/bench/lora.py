"""`shipyard bench lora`: does LoRA at rank 1 learn in RL as full fine-tuning does, at ~10x its learning rate?

"LoRA Without Regret" (Thinking Machines, 2025, https://thinkingmachines.ai/blog/lora/) reports that in policy-gradient
RL, LoRA on every linear layer at rank 1 matched full fine-tuning's learning curves when its learning rate was ~10x
full fine-tuning's: an RL episode carries about one bit (its advantage) into many tokens, so the policy needs little
capacity to take it in. The argument is a scaling one and its evidence is math reasoning on other models; issue 29 asks
for it to be checked here, on shipyard's episodes, not assumed.

**Arms** — the same `shipyard train` command on one configuration (default `configs/demo.toml`: the bundled 0.5B, the
demo's tasks, grounded-validity shaping, the signal the 0.5B does learn from while it solves nothing), the same seed,
tasks and steps; only the trainer differs:

    full            full fine-tuning at the configuration's learning rate L (`[trainer.optim] lr`)
    lora-rR         LoRA of rank R (`--rank`, default 1; α from `[trainer.lora] alpha`) at L: the control
    lora-rR-xS      LoRA of rank R at S x L (`--scale`, default 10): the claim

The runs train with `--run.evaluate false`: what is compared is what each learned on its training batches, step by
step. Each batch is sampled by the policy being trained, so arms diverge after step 1 (the first batch is the same for
all: the same base model and seeds).

**Figures.** Per arm and step the mean reward (task reward + shaping) and the grounded tool-call rate; their mean over
the late steps (the second half), with a bootstrap 95 % interval over those steps; and for each LoRA arm the paired
difference from `full` over the late steps (paired by step index). The claim holds here when `lora-rR-xS`'s difference
interval holds 0 (or lies above it) while `lora-rR`'s lies below — the learning rate, not the rank, being what LoRA
needs. Also s/step and the peak resident memory of each arm. A PNG of the curves beside the runs, tables, and one
JSON line last; exit 1 when an arm failed.

    shipyard bench lora [-- --config configs/demo.toml --steps 12 --rank 1 --scale 10 --minutes 60 --out DIR
                           --SECTION.KEY VALUE ...]

Other `--SECTION.KEY VALUE` arguments override the configuration for every arm. Resuming: run the same command with
the same `--out`; a finished arm there is reused, an unfinished one continues from its checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from shipyard.bench._common import console, finish, table
from shipyard.bench.learning import _ci, _lines, run_stage, run_state
from shipyard.rollout.eval import bootstrap_mean, paired_difference


def arms(lr: float, rank: int, scale: float) -> dict[str, list[str]]:
    """Arm name → its trainer overrides."""
    lora = ["--trainer.lora.enabled", "true", "--trainer.lora.rank", str(rank)]
    return {"full": ["--trainer.optim.lr", repr(lr)],
            f"lora-r{rank}": [*lora, "--trainer.optim.lr", repr(lr)],
            f"lora-r{rank}-x{scale:g}": [*lora, "--trainer.optim.lr", repr(lr * scale)]}


def curves(run: Path) -> dict[str, list[float | None]]:
    """Per step of a run: its mean reward, grounded tool-call rate, wall seconds and peak resident memory (MiB)."""
    steps = sorted((m for m in _lines(run / "metrics.jsonl") if m.get("step", 0) > 0), key=lambda m: m["step"])
    return {"reward": [m.get("reward/mean") for m in steps],
            "grounded": [m.get("tools/grounded_fraction") for m in steps],
            "seconds": [m.get("time/step_seconds") for m in steps],
            "peak_rss_mb": [m.get("memory/step_peak_rss_mb") for m in steps]}


def late(values: list[float | None]) -> list[float]:
    """The second half of a curve (its later steps, where a learning rate has had time to act)."""
    return [v for v in values[len(values) // 2:] if v is not None]


def compare(runs: dict[str, dict[str, list]], resamples: int) -> dict[str, Any]:
    """Late-step means per arm and each LoRA arm's paired difference from full (by step index), with intervals."""
    out: dict[str, Any] = {}
    for arm, c in runs.items():
        figure = {key: bootstrap_mean(late(c[key]), resamples=resamples) for key in ("reward", "grounded")}
        if arm != "full" and "full" in runs:
            for key in ("reward", "grounded"):
                steps = len(c[key])  # its late steps, paired with full's of the same index
                figure[f"{key}_vs_full"] = paired_difference(
                    dict(enumerate(runs["full"][key][steps // 2:steps])), dict(enumerate(c[key][steps // 2:])),
                    resamples=resamples)
        seconds = [s for s in c["seconds"] if s is not None]
        figure["seconds_per_step"] = sum(seconds) / len(seconds) if seconds else None
        figure["peak_rss_mb"] = max((m for m in c["peak_rss_mb"] if m is not None), default=None)
        figure["steps"] = len(c["reward"])
        out[arm] = figure
    return out


def verdict(figures: dict[str, Any], rank: int, scale: float) -> str:
    """What the late-step reward differences say about the claim (see the module docstring)."""
    scaled, plain = figures.get(f"lora-r{rank}-x{scale:g}", {}), figures.get(f"lora-r{rank}", {})
    s, p = scaled.get("reward_vs_full"), plain.get("reward_vs_full")
    if not s or s.get("ci95") is None:
        return "not measured"
    if s["ci95"][1] < 0:
        return f"not matched: LoRA rank {rank} at {scale:g}x learned less than full fine-tuning"
    held = "matched" if s["ci95"][0] <= 0 else "exceeded"
    if p and p.get("ci95") is not None and p["ci95"][1] < 0:
        return f"{held}, and at 1x LoRA fell short: the learning rate is what LoRA needs"
    return f"{held} (LoRA at 1x was not distinguishable from full either)"


def plot(runs: dict[str, dict[str, list]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "reward", "mean reward (task + shaping)"),
                           (axes[1], "grounded", "grounded tool-call rate")):
        for arm, c in runs.items():
            ax.plot(range(1, len(c[key]) + 1), [v if v is not None else float("nan") for v in c[key]], marker="o",
                    label=arm)
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    from shipyard.rl.demo import REPO

    p = argparse.ArgumentParser(prog="shipyard bench lora", allow_abbrev=False,
                                epilog="Other --SECTION.KEY VALUE arguments override the configuration.")
    p.add_argument("--config", type=Path, default=REPO / "configs" / "demo.toml")
    p.add_argument("--steps", type=int, default=12, help="RL steps of every arm")
    p.add_argument("--rank", type=int, default=1, help="the LoRA arms' rank")
    p.add_argument("--scale", type=float, default=10.0, help="the scaled LoRA arm's learning rate over full's")
    p.add_argument("--minutes", type=float, default=60.0, help="wall-time budget of each arm")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--out", type=Path, default=None)
    args, overrides = p.parse_known_args(argv)
    if args.steps < 2 or args.rank < 1 or not args.scale > 0 or not args.minutes > 0 or args.bootstrap < 1:
        p.error("--steps must be at least 2; --rank, --scale, --minutes and --bootstrap positive")
    args.out = args.out or Path.home() / ".cache" / "shipyard" / f"bench-lora-{time.strftime('%Y%m%d-%H%M%S')}"
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    from shipyard.rl.build import task_set
    from shipyard.rl.config import load_config

    args, overrides = parse(argv)
    config = load_config(args.config, ["--run.dir", str(args.out), *overrides])
    tasks = task_set(config, lambda m: console.print(f"[dim]· {m}[/]"))  # made once (run.synth_from), shared
    plan = arms(config.trainer.optim.lr, args.rank, args.scale)
    console.print(f"[bold]bench lora[/]: {', '.join(plan)}, {args.steps} RL steps each from {config.model.name} on "
                  f"{tasks}; out {args.out}")
    runs, records, failures = {}, {}, []
    for arm, trainer in plan.items():
        run = args.out / arm
        state = run_state(run)
        if state["status"] == "finished" and state["steps"] >= args.steps:
            records[arm] = {"reused": str(run)}
        else:
            cmd = [sys.executable, "-m", "shipyard.cli", "train", str(args.config), *overrides, *trainer,
                   "--run.dir", str(run), "--run.tasks", str(tasks), "--run.steps", str(args.steps),
                   "--run.evaluate", "false", "--run.max_minutes", str(args.minutes),
                   *(["--run.resume", "true"] if (run / "run.json").exists() else [])]
            # killed past the budget and 15 minutes: a step that started inside the budget is let end
            records[arm] = run_stage(arm, cmd, args.out / f"{arm}.log", args.minutes + 15,
                                     lambda run=run: len(_lines(run / "metrics.jsonl")), args.steps)
            state = run_state(run)
        if state["status"] != "finished" or state["steps"] < 2:
            failures.append(f"{arm}: status {state['status']} after {state['steps']} steps: "
                            f"{state['error'] or 'see ' + str(args.out / (arm + '.log'))}")
            continue
        runs[arm] = curves(run)
    figures = compare(runs, args.bootstrap)
    table("late steps (second half) per arm: mean and bootstrap 95 % interval over steps; vs full paired by step",
          ["arm", "steps", "reward", "95% CI", "vs full", "95% CI", "grounded", "vs full", "s/step", "peak RSS MiB"],
          [[arm, f["steps"], f["reward"]["mean"], _ci(f["reward"]), (f.get("reward_vs_full") or {}).get("mean"),
            _ci(f.get("reward_vs_full")), f["grounded"]["mean"], (f.get("grounded_vs_full") or {}).get("mean"),
            f["seconds_per_step"], f["peak_rss_mb"]] for arm, f in figures.items()])
    table("reward per step", ["arm", *(str(i) for i in range(1, args.steps + 1))],
          [[arm, *c["reward"]] for arm, c in runs.items()])
    said = verdict(figures, args.rank, args.scale)
    console.print(f"LoRA rank {args.rank} at {args.scale:g}x the learning rate vs full fine-tuning: [bold]{said}[/]")
    png = args.out / "lora.png"
    if runs:
        plot(runs, png)
    result = {"arms": figures, "curves": runs, "verdict": said, "lr": config.trainer.optim.lr, "rank": args.rank,
              "scale": args.scale, "steps": args.steps, "config": str(args.config), "tasks": str(tasks),
              "plot": str(png) if runs else None, "runs": records, "failures": failures}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora.json").write_text(json.dumps(result, indent=1) + "\n")
    if failures:
        console.print("[bold red]the comparison is incomplete:[/] " + "; ".join(failures), soft_wrap=True)
    finish("lora", result)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
