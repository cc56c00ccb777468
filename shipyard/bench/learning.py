"""`shipyard bench learning`: does targeted textual feedback make the agent learn faster than the reward alone?

Arms, each a real `shipyard train` run of one configuration (default `configs/demo.toml`: the bundled 0.5B, tasks
synthesized from the example repository, AdamW) with the same seeds, tasks and held-out split, and the same budget
(`--steps`, or `--minutes` of wall time: the run stops itself after the step that reaches the budget less
`--eval-reserve` and evaluates — `run.max_minutes` —, and is killed only if that overruns the budget; either way the
arm is reported with the steps it made):

    reward     the configuration as it is (the grader's reward and its shaping terms)
    feedback   + hints (`--hints.enabled true`: hint detectors, targeted self-distillation; shipyard/rl/hints.py)
    effort     + effort calibration (`--shaping.effort E`: a group-relative length/turn cost by tier)

Figures (issue 16):

(a) the **behaviour rate** per training step — grounded tool-call validity (`tools/grounded_fraction`: a real tool,
    the wire format, arguments that refer to the task, ran without error; shipyard/harness/validity.py) — and the
    **invalid rate**, the share of calls the harness could not take as written (untagged, truncated, malformed,
    unknown tool, bad arguments), smoothed over `--window` steps. `steps_ratio` = (first step at which the feedback
    arm's smoothed rate reaches the reward arm's final one) / (the reward arm's steps); null, with the reason, when
    the reward arm did not improve the rate at all (then there is nothing to reach) or the feedback arm never gets
    there. `invalid_halved`: the feedback arm's final invalid rate is at most half its first;
(b) held-out **pass@1** before and after each arm (`eval/step-*.json`), with a 95% bootstrap interval of the change
    (tasks resampled with replacement, `--bootstrap` resamples);
(c) **tokens and turns per solved task by tier**, training rollouts and held-out ones, per arm (null where nothing
    was solved).

Curves are saved as PNG beside the runs; the last line is one JSON object. An arm's run directory can be reused
(`--reuse reward=DIR`: a finished `shipyard train`/`shipyard demo` run of the same configuration, e.g. the 20-step
curves run) instead of training it again; the tasks of the first arm (or `--tasks DIR`) are given to the others.

    shipyard bench learning [-- --steps 20 --minutes 60 --arms reward,feedback --out DIR --reuse reward=DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from rich.progress import Progress, TimeElapsedColumn

from shipyard.bench._common import console, finish, table
from shipyard.rl.demo import DEMO_CONFIG

ARMS = {"reward": [], "feedback": ["--hints.enabled", "true"], "effort": ["--shaping.effort", "{effort}"]}
FORMAT_PROBLEMS = ("untagged_ran", "untagged", "truncated", "malformed", "unknown_tool", "bad_arguments")


def train_arm(name: str, config: Path, run_dir: Path, args: argparse.Namespace, tasks: Path | None) -> dict:
    """Train one arm in a subprocess, cut at the wall-time budget; what happened."""
    overrides = [a.format(effort=args.effort) for a in ARMS[name]]
    # The run stops itself after the step that reaches the budget less the reserve, then evaluates and checkpoints
    # (`run.max_minutes`); the benchmark kills it only if that overruns the whole budget.
    soft = max(args.minutes - args.eval_reserve, 0.1)
    cmd = [sys.executable, "-m", "shipyard.cli", "train", str(config), "--run.dir", str(run_dir), "--run.steps",
           str(args.steps), "--run.eval_every", str(args.eval_every), "--run.checkpoint_every", str(args.steps),
           "--run.max_minutes", str(soft),
           *(["--run.tasks", str(tasks)] if tasks else []), *overrides]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log")
    start = time.monotonic()
    deadline = start + args.minutes * 60
    rc, cut = None, False
    with open(log, "w") as out, Progress(*Progress.get_default_columns(), TimeElapsedColumn(),
                                          console=console) as progress:
        bar = progress.add_task(f"arm {name} (log: {log})", total=args.steps)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while rc is None:
                try:
                    rc = proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        cut = True
                        break
                progress.update(bar, completed=len(read_run(run_dir)[0]))
        finally:
            if proc.poll() is None:  # cut at the budget, or the benchmark itself interrupted: stop the whole run
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return {"command": " ".join(cmd), "returncode": rc, "cut_at_budget": cut, "seconds": time.monotonic() - start,
            "log": str(log)}


def read_run(run_dir: Path) -> tuple[list[dict], dict[int, dict]]:
    """(metrics lines of the training steps, eval documents by step)."""
    path = run_dir / "metrics.jsonl"
    # lines end with a newline; what follows the last one is a line still being written (read while training)
    lines = [json.loads(x) for x in path.read_text().split("\n")[:-1] if x.strip()] if path.exists() else []
    evals = {int(p.stem.split("-")[1]): json.loads(p.read_text())
             for p in sorted((run_dir / "eval").glob("step-*.json"))}
    return [m for m in lines if m["step"] > 0 and "tools/calls" in m], evals


def rates(steps: list[dict]) -> tuple[list[float], list[float]]:
    """Per step: grounded fraction and format-invalid fraction of the batch's tool calls (0 without calls)."""
    grounded, invalid = [], []
    for m in steps:
        calls = m.get("tools/calls", 0) or 0
        grounded.append(m.get("tools/grounded_fraction", 0.0) or 0.0)
        bad = sum(m.get(f"tools/not_grounded_{p}", 0) or 0 for p in FORMAT_PROBLEMS)
        invalid.append(bad / calls if calls else 0.0)
    return grounded, invalid


def smooth(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def steps_ratio(reward: list[float], feedback: list[float]) -> tuple[float | None, str]:
    """(steps for the feedback arm to reach the reward arm's final smoothed rate / the reward arm's steps, why)."""
    if not reward or not feedback:
        return None, "an arm made no step"
    target, start = reward[-1], reward[0]
    if target <= start:
        return None, f"the reward-only arm did not raise the rate (start {start:.3f}, final {target:.3f})"
    reached = next((i + 1 for i, v in enumerate(feedback) if v >= target), None)
    if reached is None:
        return None, f"the feedback arm never reached the reward-only arm's final rate {target:.3f}"
    return reached / len(reward), f"reached {target:.3f} at step {reached}; the reward-only arm made {len(reward)}"


def pass_change(evals: dict[int, dict], resamples: int, seed: int = 0) -> dict:
    """pass@1 at the first and last evaluation, and a bootstrap 95% interval of the change (tasks resampled)."""
    if len(evals) < 2:
        return {"before": None, "after": None, "change": None, "ci95": None, "note": "fewer than two evaluations"}
    first, last = evals[min(evals)], evals[max(evals)]
    tasks = sorted(set(first["tasks"]) & set(last["tasks"]))
    per_task = {t: (first["tasks"][t]["pass_at"]["1"], last["tasks"][t]["pass_at"]["1"]) for t in tasks}
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        pick = [rng.choice(tasks) for _ in tasks]
        draws.append(sum(per_task[t][1] - per_task[t][0] for t in pick) / len(pick))
    draws.sort()
    lo, hi = draws[int(0.025 * len(draws))], draws[min(len(draws) - 1, int(0.975 * len(draws)))]
    return {"before": first["overall"]["pass_at"]["1"], "after": last["overall"]["pass_at"]["1"],
            "change": last["overall"]["pass_at"]["1"] - first["overall"]["pass_at"]["1"], "ci95": [lo, hi],
            "tasks": len(tasks), "steps": [min(evals), max(evals)]}


def effort_by_tier(run_dir: Path, evals: dict[int, dict]) -> dict:
    """Tokens and turns per rollout and per solved rollout, by tier (from the task index), training and held-out."""
    index = {}
    for tasks_dir in (run_dir / "tasks", Path(_config(run_dir).get("run", {}).get("tasks", run_dir / "tasks"))):
        if (tasks_dir / "tasks.jsonl").exists():
            index = {e["id"]: e["tier"] for e in map(json.loads, (tasks_dir / "tasks.jsonl").read_text().splitlines())}
            break
    rows = {"train": [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
            if (run_dir / "rollouts.jsonl").exists() else [],
            "held_out": [r for doc in evals.values() for r in doc.get("rollouts", [])]}
    out: dict = {}
    for where, rollouts in rows.items():
        for r in rollouts:
            if r.get("reward") is None:
                continue
            tier = str(index.get(r["task"], "?"))
            cell = out.setdefault(where, {}).setdefault(tier, {"rollouts": 0, "solved": 0, "tokens": 0, "turns": 0,
                                                                "solved_tokens": 0, "solved_turns": 0})
            solved = r["reward"] >= 1.0
            cell["rollouts"] += 1
            cell["solved"] += solved
            cell["tokens"] += r.get("sampled_tokens", 0)
            cell["turns"] += r.get("turns", 0)
            cell["solved_tokens"] += r.get("sampled_tokens", 0) * solved
            cell["solved_turns"] += r.get("turns", 0) * solved
    for cells in out.values():
        for cell in cells.values():
            n, s = cell["rollouts"], cell["solved"]
            cell.update(tokens_per_rollout=cell["tokens"] / n, turns_per_rollout=cell["turns"] / n,
                        tokens_per_solved=cell["solved_tokens"] / s if s else None,
                        turns_per_solved=cell["solved_turns"] / s if s else None)
    return out


def _config(run_dir: Path) -> dict:
    path = run_dir / "config.toml"
    return tomllib.loads(path.read_text()) if path.exists() else {}


def plot(curves: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for arm, c in curves.items():
        steps = list(range(1, len(c["grounded"]) + 1))
        axes[0].plot(steps, c["grounded"], marker="o", label=arm)
        axes[1].plot(steps, c["invalid"], marker="o", label=arm)
        axes[2].plot(steps, c["reward"], marker="o", label=arm)
    for ax, title in zip(axes, ("grounded tool-call validity (smoothed)", "format-invalid calls (smoothed)",
                                "grader reward mean"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(prog="shipyard bench learning")
    p.add_argument("--config", type=Path, default=DEMO_CONFIG)
    p.add_argument("--arms", default="reward,feedback")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--minutes", type=float, default=60.0, help="wall-time budget of each arm")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-reserve", type=float, default=None,
                   help="minutes of each arm's budget kept for its final held-out eval (default: 8, or a quarter "
                        "of --minutes when that is less)")
    p.add_argument("--effort", type=float, default=0.1, help="shaping.effort of the effort arm")
    p.add_argument("--window", type=int, default=3, help="steps of the moving average of the rates")
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tasks", type=Path, default=None, help="a task set for every arm (default: the first arm's)")
    p.add_argument("--reuse", action="append", default=[], metavar="ARM=DIR", help="use a finished run as an arm")
    args = p.parse_args()
    if not args.minutes > 0:
        p.error(f"--minutes must be more than 0, not {args.minutes:g}")
    if args.eval_reserve is None:
        args.eval_reserve = min(8.0, args.minutes / 4)
    if not 0 <= args.eval_reserve < args.minutes:
        p.error(f"--eval-reserve must be at least 0 and less than --minutes ({args.minutes:g}), "
                f"not {args.eval_reserve:g}")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    reuse = dict(item.split("=", 1) for item in args.reuse)
    if unknown or set(reuse) - set(arms):
        print(f"error: arms must be among {', '.join(ARMS)}; --reuse names an arm of --arms", file=sys.stderr)
        return 2
    out = args.out or Path.home() / ".cache" / "shipyard" / f"bench-learning-{time.strftime('%Y%m%d-%H%M%S')}"
    tasks = args.tasks
    runs, dirs = {}, {}
    for arm in arms:
        if arm in reuse:
            dirs[arm] = Path(reuse[arm])
            runs[arm] = {"reused": str(dirs[arm])}
        else:
            dirs[arm] = out / arm
            runs[arm] = train_arm(arm, args.config, dirs[arm], args, tasks)
        if tasks is None:
            tasks = Path(_config(dirs[arm]).get("run", {}).get("tasks") or dirs[arm] / "tasks")
        status = json.loads((dirs[arm] / "run.json").read_text()) if (dirs[arm] / "run.json").exists() else {}
        killed = runs[arm].get("cut_at_budget") and status.get("status") == "running"
        runs[arm]["status"] = "killed at the budget" if killed else status.get("status", "missing")
        if status.get("stopped"):
            runs[arm]["stopped"] = status["stopped"]  # the run's own time budget: it evaluated and checkpointed

    curves, summary = {}, {}
    for arm in arms:
        steps, evals = read_run(dirs[arm])
        grounded, invalid = rates(steps)
        g, v = smooth(grounded, args.window), smooth(invalid, args.window)
        curves[arm] = {"grounded": g, "invalid": v, "reward": [m.get("reward/mean") or 0.0 for m in steps]}
        summary[arm] = {"steps": len(steps), "start_rate": g[0] if g else None, "end_rate": g[-1] if g else None,
                        "start_invalid": v[0] if v else None, "end_invalid": v[-1] if v else None,
                        "invalid_halved": bool(v) and v[-1] <= 0.5 * v[0] and v[0] > 0,
                        "hints": sum(m.get("hints/count", 0) or 0 for m in steps),
                        "hint_lift": [m.get("train/hint_lift") for m in steps if "train/hint_lift" in m],
                        "seconds_per_step": sum(m.get("time/step_seconds", 0) for m in steps) / max(len(steps), 1),
                        "pass_at_1": pass_change(evals, args.bootstrap),
                        "effort": effort_by_tier(dirs[arm], evals), **runs[arm]}
    ratio, why = steps_ratio(curves["reward"]["grounded"], curves["feedback"]["grounded"]) \
        if "reward" in curves and "feedback" in curves else (None, "needs the reward and feedback arms")

    table("behaviour rate per arm (grounded tool-call validity; format-invalid share of calls; smoothed)",
          ["arm", "steps", "s/step", "rate start", "rate end", "invalid start", "invalid end", "hints", "status"],
          [[a, s["steps"], s["seconds_per_step"], s["start_rate"], s["end_rate"], s["start_invalid"],
            s["end_invalid"], s["hints"], s["status"] + (" (cut)" if s.get("cut_at_budget") else "")]
           for a, s in summary.items()])
    table("held-out pass@1", ["arm", "before", "after", "change", "95% CI", "tasks"],
          [[a, s["pass_at_1"]["before"], s["pass_at_1"]["after"], s["pass_at_1"]["change"],
            s["pass_at_1"]["ci95"], s["pass_at_1"].get("tasks")] for a, s in summary.items()])
    table("effort by tier (training rollouts)", ["arm", "tier", "rollouts", "solved", "tokens/rollout",
                                                 "turns/rollout", "tokens/solved", "turns/solved"],
          [[a, tier, c["rollouts"], c["solved"], c["tokens_per_rollout"], c["turns_per_rollout"],
            c["tokens_per_solved"], c["turns_per_solved"]]
           for a, s in summary.items() for tier, c in sorted(s["effort"].get("train", {}).items())])
    out.mkdir(parents=True, exist_ok=True)
    png = out / "learning.png"
    plot(curves, png)
    print(f"steps_ratio: {ratio} ({why}); curves: {png}")
    finish("learning", {"arms": summary, "steps_ratio": ratio, "steps_ratio_note": why, "plot": str(png),
                        "config": str(args.config), "steps": args.steps, "minutes": args.minutes})
    failed = [a for a, s in summary.items() if s["status"] != "finished" and not s.get("cut_at_budget")]
    return 1 if failed or any(s["steps"] == 0 for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
