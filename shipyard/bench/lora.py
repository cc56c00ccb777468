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
import sys
import time
from pathlib import Path
from typing import Any

from rich.markup import escape

from shipyard.bench._common import console, finish, status, table
from shipyard.bench._stages import ci_text, read_json, read_lines, run_stage, run_state, write_json
from shipyard.rollout.eval import bootstrap_mean, paired_difference

MIN_LATE = 4  # late steps below which no verdict is given: an interval over fewer says nothing


def arms(lr: float, rank: int, scale: float) -> dict[str, list[str]]:
    """Arm name → its trainer overrides (the full arm turns LoRA off, whatever the configuration says)."""
    lora = ["--trainer.lora.enabled", "true", "--trainer.lora.rank", str(rank)]
    return {"full": ["--trainer.lora.enabled", "false", "--trainer.optim.lr", repr(lr)],
            f"lora-r{rank}": [*lora, "--trainer.optim.lr", repr(lr)],
            f"lora-r{rank}-x{scale:g}": [*lora, "--trainer.optim.lr", repr(lr * scale)]}


def curves(run: Path, steps: int) -> dict[str, list[float | None]]:
    """Per step of a run (its first `steps`): mean reward, grounded tool-call rate, wall seconds and peak resident
    memory (MiB)."""
    rows = sorted((m for m in read_lines(run / "metrics.jsonl") if m.get("step", 0) > 0), key=lambda m: m["step"])
    rows = rows[:steps]
    return {"reward": [m.get("reward/mean") for m in rows],
            "grounded": [m.get("tools/grounded_fraction") for m in rows],
            "seconds": [m.get("time/step_seconds") for m in rows],
            "peak_rss_mb": [m.get("memory/step_peak_rss_mb") for m in rows]}


def _over_steps(figure: dict[str, Any]) -> dict[str, Any]:
    """A bootstrap figure whose units are steps (`bootstrap_mean` counts `tasks`)."""
    return {"mean": figure["mean"], "ci95": figure["ci95"], "steps": figure["tasks"]}


def compare(runs: dict[str, dict[str, list]], resamples: int) -> dict[str, Any]:
    """Per arm, the mean over the late steps — the second half of the steps every arm made, one window for all —
    with its bootstrap interval over those steps, and each LoRA arm's difference from full paired by step."""
    n = min((len(c["reward"]) for c in runs.values()), default=0)
    window = range(n // 2, n)
    out: dict[str, Any] = {}
    for arm, c in runs.items():
        figure: dict[str, Any] = {"late_steps": [i + 1 for i in window]}
        for key in ("reward", "grounded"):
            late = [c[key][i] for i in window if c[key][i] is not None]
            figure[key] = _over_steps(bootstrap_mean(late, resamples=resamples))
            if arm != "full" and "full" in runs:
                figure[f"{key}_vs_full"] = _over_steps(paired_difference(
                    {i: runs["full"][key][i] for i in window}, {i: c[key][i] for i in window}, resamples=resamples))
        seconds = [s for s in c["seconds"] if s is not None]
        figure["seconds_per_step"] = sum(seconds) / len(seconds) if seconds else None
        figure["peak_rss_mb"] = max((m for m in c["peak_rss_mb"] if m is not None), default=None)
        figure["steps"] = len(c["reward"])
        out[arm] = figure
    return out


def _side(figure: dict[str, Any] | None) -> str | None:
    """Where a difference's interval lies: below 0, above 0, or holding 0 (None: not measured)."""
    if not figure or figure.get("ci95") is None:
        return None
    lo, hi = figure["ci95"]
    return "below" if hi < 0 else "above" if lo > 0 else "holds 0"


def verdict(figures: dict[str, Any], rank: int, scale: float) -> str:
    """What the late-step reward differences from full say, in words that claim no more than one run's intervals
    (one seed per arm; steps resampled as if independent)."""
    scaled = figures.get(f"lora-r{rank}-x{scale:g}", {}).get("reward_vs_full")
    plain = figures.get(f"lora-r{rank}", {}).get("reward_vs_full")
    if _side(scaled) is None:
        return "not measured (an arm did not finish)"
    if scaled["steps"] < MIN_LATE:
        return f"not measured: {scaled['steps']} late step(s), fewer than {MIN_LATE} (run more --steps)"
    words = {"below": "below full fine-tuning", "above": "above full fine-tuning",
             "holds 0": "not distinguishable from full fine-tuning"}
    said = f"at {scale:g}x, LoRA rank {rank} was {words[_side(scaled)]} (reward interval {ci_text(scaled)})"
    plain_side = _side(plain)
    said += "; the 1x arm did not finish" if plain_side is None else \
        f"; at 1x it was {words[plain_side]} ({ci_text(plain)})"
    return said + " — in this one run"


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
    tasks = task_set(config, status)  # made once (run.synth_from), shared
    plan = arms(config.trainer.optim.lr, args.rank, args.scale)
    console.print(f"[bold]bench lora[/]: {', '.join(plan)}, {args.steps} RL steps each from "
                  f"{escape(config.model.name)} on {escape(str(tasks))}; out {escape(str(args.out))}")
    runs, records, failures = {}, {}, []
    made = read_json(args.out / "arms.json")  # arm → the command that trained it (less --run.resume)
    for arm, trainer in plan.items():
        run = args.out / arm
        cmd = [sys.executable, "-m", "shipyard.cli", "train", str(args.config.resolve()), *overrides, *trainer,
               "--run.dir", str(run), "--run.tasks", str(tasks), "--run.steps", str(args.steps),
               "--run.evaluate", "false", "--run.max_minutes", str(args.minutes)]
        state = run_state(run)
        if (run / "run.json").exists() and made.get(arm) != cmd[1:]:
            failures.append(f"{arm}: {run} was trained by another command (configuration, overrides or steps): "
                            "give another --out, or delete it to train it again")
            continue
        if state["status"] == "finished" and state["steps"] >= args.steps:
            records[arm] = {"reused": str(run)}
        else:
            resumed = (run / "run.json").exists()
            made[arm] = cmd[1:]
            write_json(args.out / "arms.json", made)
            # killed past the budget and 15 minutes: a step that started inside the budget is let end
            records[arm] = run_stage(arm, [*cmd, *(["--run.resume", "true"] if resumed else [])],
                                     args.out / f"{arm}.log", args.minutes + 15,
                                     lambda run=run: run_state(run)["steps"], args.steps)
            state = run_state(run)
        if state["status"] != "finished" or state["steps"] < args.steps:
            why = "killed at --minutes + 15" if records[arm].get("cut_at_budget") else \
                f"stopped at --minutes {args.minutes:g}" if state["stopped"] == "max_minutes" else \
                f"status {state['status']}: {state['error'] or 'see ' + str(args.out / (arm + '.log'))}"
            failures.append(f"{arm}: {state['steps']} of {args.steps} steps ({why}); raise --minutes, and run the "
                            "same command again to resume it")
            continue
        runs[arm] = curves(run, args.steps)
    figures = compare(runs, args.bootstrap)
    table("late steps (second half) per arm: mean and bootstrap 95 % interval over steps; vs full paired by step",
          ["arm", "steps", "reward", "95% CI", "vs full", "95% CI", "grounded", "vs full", "s/step", "peak RSS MiB"],
          [[arm, f["steps"], f["reward"]["mean"], ci_text(f["reward"]), (f.get("reward_vs_full") or {}).get("mean"),
            ci_text(f.get("reward_vs_full")), f["grounded"]["mean"], (f.get("grounded_vs_full") or {}).get("mean"),
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
    write_json(args.out / "lora.json", result)
    if failures:
        console.print("[bold red]the comparison is incomplete:[/] " + "; ".join(failures), soft_wrap=True)
    finish("lora", result)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
