"""`shipyard bench learning`: does the recipe make the agent *solve* more tasks of projects it never trained on?

RL sharpens what a policy already does sometimes; the bundled 0.5B solves none of the tasks before training, so RL
alone has no success to learn from (issue 29). The recipe of agent-RL work is a cold start first — supervised
fine-tuning on solved trajectories — then RL. This benchmark measures each stage of it on held-out projects.

**Arms**, from one configuration (default `configs/learning.toml`: the bundled 0.5B, the task pool with
`[run] held_out_projects`, `[sft] sources = ["gold"]`), each the real command as a user runs it, in a subprocess:

    base            the starting model (`[model] name`), evaluated as it is
    sft             `shipyard sft CONFIG`: fine-tuned on the training tasks' demonstrations, from the base
    sft+rl          `shipyard train CONFIG --model.name SFT/export`: RL from the SFT export
    rl              `shipyard train CONFIG`: RL from the base (optional)
    sft+rl+hints    as sft+rl with `--hints.enabled true` (optional)

Every arm is evaluated the same way: `shipyard eval` on the arm's model (the base name, or a stage's RUN/export)
over the same held-out task ids (the configuration's split, computed once here; each training stage's recorded split
is checked against it, so no stage trained on an evaluated task), with the same samples, seed and episode settings
(`[episode.loop]` turns, tokens, temperature and wire, `[episode] grade_timeout`, `[run] seed`). One evaluation path
for all arms: what differs between arms is the weights, nothing else.

**Budgets.** Each training stage gets `--minutes` of wall time: `shipyard train` and `shipyard sft` stop themselves
after the step that reaches the budget less `--eval-reserve` (`run.max_minutes`) and checkpoint; a stage still
running at the budget is killed, reported as such, and fails the measurement — the same command resumes it from its
last checkpoint. The budget is the stage's in all: a stage that stopped itself at it is reused by the same command,
and continued from its checkpoint by one with a larger `--minutes` for what is left of it (its earlier runs here
counted; `OUT/budgets.json` keeps the budget each stage last ran under). Evaluations run to their end.

**Cost.** The RL stages run with `--run.evaluate false`: the benchmark evaluates every arm itself, the same way, so
the runs' own before/after evaluations would be the same work twice.

**Resuming.** A long measurement is resumed stage by stage: run the same command with the same `--out`. A training
stage whose run directory there is finished (with an export) is reused, an unfinished one continues from its last
checkpoint (`--run.resume true`), and an arm's evaluation file there is reused when it evaluated the same model, tasks,
samples, seed and episode settings. An evaluation that was stopped goes on from its journal (`ARM.rollouts.jsonl`,
`shipyard eval --resume`): its finished rollouts are kept when the journal's settings are this arm's and its model was
not exported again since. `--reuse ARM=DIR` uses a finished run elsewhere as the arm's stage, `--reuse
ARM=FILE.json` an evaluation elsewhere as the arm's results (checked the same way, but for the model).

**Figures.** pass@1 per arm over the held-out tasks × samples, with a bootstrap 95 % interval over tasks; for every
arm the paired difference from base, and `delta_rl` = (sft+rl) − sft, each with its paired bootstrap 95 % interval
(tasks resampled, arms paired by task: `shipyard.rollout.eval.paired_difference`); tokens and turns per solved
rollout per arm; the wall time of every stage and evaluation; the RL stages' grounded tool-call validity per step.
A PNG beside the runs, tables, and one JSON line last. Exit 1 when a stage failed or an arm could not be evaluated.

    shipyard bench learning [-- --config configs/learning.toml --arms base,sft,sft+rl --samples 2 --minutes 360
                                --out DIR --reuse sft=DIR --sft-args "--sft.epochs 3" --run.steps 30 ...]

Arguments the benchmark does not know are configuration overrides (`--SECTION.KEY VALUE`) for every stage and for
the evaluations' settings; `--sft-args` and `--rl-args` add overrides to the SFT stage or to the RL stages only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.progress import Progress, TimeElapsedColumn

from shipyard.bench._common import console, finish, table
from shipyard.rollout.eval import bootstrap_mean, paired_difference, task_rates

ARMS = ("base", "sft", "sft+rl", "rl", "sft+rl+hints")
# stage → (command, the stage whose export it starts from (None: the base model), its own overrides)
NO_EVAL = ["--run.evaluate", "false"]  # the benchmark evaluates every arm itself, the same way
STAGES: dict[str, tuple[str, str | None, list[str]]] = {
    "sft": ("sft", None, []), "sft+rl": ("train", "sft", NO_EVAL), "rl": ("train", None, NO_EVAL),
    "sft+rl+hints": ("train", "sft", [*NO_EVAL, "--hints.enabled", "true"])}
LOOP_SETTINGS = ("max_turns", "max_new_tokens", "temperature", "untagged_calls", "tags")


def eval_settings(config, held_out: list[str], samples: int) -> dict[str, Any]:
    """What two evaluations must share to be compared (as a results document's `config` records it)."""
    loop = config.episode.loop
    return {"task_ids": sorted(held_out), "samples": samples, "seed": config.run.seed,
            "grade_timeout": config.episode.grade_timeout, **{k: getattr(loop, k) for k in LOOP_SETTINGS}}


def eval_command(config, tasks: Path, model: str, held_out: list[str], samples: int, concurrency: int,
                 out: Path) -> list[str]:
    """`shipyard eval` of `model` (an engine's name: `vllm:DIR` samples on a vLLM server) with the configuration's
    episode settings (`eval_settings`)."""
    loop = config.episode.loop
    return [sys.executable, "-m", "shipyard.cli", "eval", "--tasks", str(tasks), "--model", model,
            *(x for t in held_out for x in ("--task", t)), "--samples", str(samples), "--seed", str(config.run.seed),
            "--concurrency", str(concurrency), "--max-turns", str(loop.max_turns), "--max-new-tokens",
            str(loop.max_new_tokens), "--temperature", str(loop.temperature), "--grade-timeout",
            str(config.episode.grade_timeout), "--untagged", loop.untagged_calls, "--tags", loop.tags,
            "--device", config.engine.device, *(["--search"] if config.episode.search else []),
            "--out", str(out), "--rollouts", str(out.with_suffix(".rollouts.jsonl"))]


def journal_usable(journal: Path, expected: dict[str, Any], model: str, engine: str) -> bool:
    """Whether the stopped evaluation journalled in `journal` is this arm's (its settings file, `shipyard.rollout.
    evalrun.settings_path`, names the same model, `engine` its name as given to `shipyard eval`, and the same episode
    settings; the model not exported again since)."""
    from shipyard.rollout.evalrun import settings_path

    settings = _json(settings_path(journal))
    episode = settings.get("episode", {})
    seen = {"grade_timeout": episode.get("grade_timeout"), **{k: episode.get("loop", {}).get(k) for k in LOOP_SETTINGS}}
    return (journal.is_file() and settings.get("model") == engine and not newer(Path(model) / "config.json", journal)
            and all(seen[k] == expected[k] for k in seen))


def eval_mismatch(doc: dict[str, Any], expected: dict[str, Any], model: str | None) -> str | None:
    """Why an existing results document is not this arm's evaluation (None: it is)."""
    c = doc.get("config", {})
    seen = {"task_ids": sorted(c.get("task_ids", [])), "samples": c.get("samples"), "seed": c.get("seed"),
            "grade_timeout": c.get("grade_timeout"), **{k: c.get("loop", {}).get(k) for k in LOOP_SETTINGS}}
    if model is not None:
        seen["model"], expected = c.get("model"), {**expected, "model": model}
    wrong = [f"{k} {seen[k]!r} (here {v!r})" for k, v in expected.items() if seen[k] != v]
    return "; ".join(wrong) or None


def run_stage(label: str, cmd: list[str], log: Path, minutes: float | None, done: Callable[[], int],
              total: int | None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` (with `env` added to the environment) and its output in `log`, killed (its whole process group)
    past `minutes`; what happened."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = None if minutes is None else start + minutes * 60
    rc, cut = None, False
    with open(log, "w") as out, Progress(*Progress.get_default_columns(), TimeElapsedColumn(),
                                          console=console) as progress:
        bar = progress.add_task(f"{label} (log: {log})", total=total)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        try:
            while rc is None:
                try:
                    rc = proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    if deadline is not None and time.monotonic() > deadline:
                        cut = True
                        break
                progress.update(bar, completed=done())
        finally:
            if proc.poll() is None:  # cut at the budget, or the benchmark itself interrupted: stop the whole stage
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return {"command": shlex.join(cmd), "returncode": rc, "cut_at_budget": cut, "seconds": time.monotonic() - start,
            "log": str(log)}


def _lines(path: Path) -> list[dict[str, Any]]:
    # lines end with a newline; what follows the last one is a line still being written (read while running)
    return [json.loads(x) for x in path.read_text().split("\n")[:-1] if x.strip()] if path.exists() else []


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def newer(a: Path, b: Path) -> bool:
    """Whether `a` was written after `b` (False when either is missing): an export newer than what was made from
    it means the stage before was trained again, and what follows it is stale."""
    return a.is_file() and b.is_file() and a.stat().st_mtime > b.stat().st_mtime


def run_state(run: Path) -> dict[str, Any]:
    """A training run directory as the benchmark sees it: status, steps, its recorded split and starting model, the
    grounded-validity curve of its steps."""
    status = _json(run / "run.json")
    saved = tomllib.loads((run / "config.toml").read_text()) if (run / "config.toml").is_file() else {}
    steps = [m for m in _lines(run / "metrics.jsonl") if m.get("step", 0) > 0]
    return {"status": status.get("status", "missing"), "stopped": status.get("stopped"),
            "error": status.get("error"), "export": (run / "export" / "config.json").is_file(),
            "held_out": sorted(saved.get("run", {}).get("held_out", [])), "model": saved.get("model", {}).get("name"),
            "steps": len(steps), "grounded": [m.get("tools/grounded_fraction") for m in steps if "tools/calls" in m],
            "recorded_seconds": status["updated"] - status["started"] if "started" in status else None}


class Bench:
    """One measurement: the configuration, its held-out split, and the stages and evaluations run or reused."""

    def __init__(self, args: argparse.Namespace, overrides: list[str]) -> None:
        from shipyard.rl.build import split, task_set
        from shipyard.rl.config import load_config

        self.args, self.overrides, self.out = args, overrides, args.out
        self.config = load_config(args.config, ["--run.dir", str(self.out), *overrides])
        self.tasks = task_set(self.config, lambda m: console.print(f"[dim]· {m}[/]"))
        self.held_out = sorted(split(self.config, self.tasks)[1])
        self.expected = eval_settings(self.config, self.held_out, args.samples)
        from shipyard.models.vllm_server import PYTHON_ENV

        self.engine = sampler(args.engine, self.config)
        # where the evaluations' vllm: engines find vLLM: the configuration's [vllm] python
        self.env = {PYTHON_ENV: str(self.config.vllm.python)} if self.engine == "vllm" else {}
        self.runs: dict[str, dict[str, Any]] = {}  # stage or "eval ARM" → what happened
        self.failures: list[str] = []
        self.seconds_path = self.out / "stages.json"  # wall seconds of what ran here, kept for a resumed measurement
        self.seconds: dict[str, float] = _json(self.seconds_path)
        self.budgets_path = self.out / "budgets.json"  # the steps' budget (minutes) each stage here last ran under

    def ran(self, key: str, record: dict[str, Any], resumed: bool = False) -> dict[str, Any]:
        """Note the wall time of a stage run here (a resumed stage adds to what its earlier runs took)."""
        self.seconds[key] = (self.seconds.get(key, 0.0) if resumed else 0.0) + record["seconds"]
        self.out.mkdir(parents=True, exist_ok=True)
        self.seconds_path.write_text(json.dumps(self.seconds, indent=1) + "\n")
        return {**record, "seconds": self.seconds[key]}

    def model_of(self, arm: str) -> str:
        return self.config.model.name if arm == "base" else str(self.stage_dir(arm).resolve() / "export")

    def engine_of(self, arm: str) -> str:
        """The name `shipyard eval` opens the arm's model by: on a vLLM server when the benchmark samples with one."""
        return f"vllm:{self.model_of(arm)}" if self.engine == "vllm" else self.model_of(arm)

    def stage_dir(self, stage: str) -> Path:
        reused = self.args.reuse_runs.get(stage)
        return Path(reused) if reused else self.out / stage

    def stage(self, stage: str) -> bool:
        """Train `stage` (after the stage it starts from), or reuse it; whether its export can be evaluated."""
        if stage in self.runs:
            return self.runs[stage]["ok"]
        command, parent, extra = STAGES[stage]
        if parent is not None and not self.stage(parent):
            self.runs[stage] = {"ok": False, "problem": f"not run: it starts from {parent}, which failed"}
            self.failures.append(f"{stage}: not run ({parent} failed)")
            return False
        run = self.stage_dir(stage)
        start = self.model_of(parent) if parent else self.config.model.name
        state = run_state(run)
        a = self.args
        minutes = a.minutes - a.eval_reserve  # the stage's steps' budget (`run.max_minutes`)
        left = self.budget_left(stage, state, minutes)
        if stage in a.reuse_runs or (state["status"] == "finished" and state["export"] and left is None):
            seconds = state["recorded_seconds"] if stage in a.reuse_runs else self.seconds.get(stage)
            record = {"reused": str(run), "seconds": seconds}
        else:
            per_stage = shlex.split(a.sft_args if command == "sft" else a.rl_args)
            resumed = (run / "run.json").exists()
            minutes = max(minutes if left is None else left, 0.1)
            cmd = [sys.executable, "-m", "shipyard.cli", command, str(a.config), *self.overrides, *per_stage,
                   "--run.dir", str(run), "--run.tasks", str(self.tasks), "--model.name", start,
                   "--run.max_minutes", str(minutes), *extra,
                   *(["--engine.kind", self.engine] if command == "train" else []),
                   *(["--run.resume", "true"] if resumed else [])]
            record = run_stage(stage, cmd, self.out / f"{stage}.log", minutes + a.eval_reserve,
                               lambda: len([m for m in _lines(run / "metrics.jsonl") if m.get("step", 0) > 0]),
                               self.config.run.steps if command == "train" else None)
            record = self.ran(stage, record, resumed)
            self.budgets_path.write_text(json.dumps({**_json(self.budgets_path), stage: a.minutes - a.eval_reserve}))
            state = run_state(run)
        why = self._stage_problem(run, state, start, record)
        self.runs[stage] = {**record, **{k: state[k] for k in ("status", "stopped", "steps", "grounded")},
                            "ok": why is None, **({"problem": why} if why else {})}
        if why:
            self.failures.append(f"{stage}: {why}")
        return why is None

    def budget_left(self, stage: str, state: dict[str, Any], minutes: float) -> float | None:
        """Minutes still owed to a stage that stopped itself at its budget (`stopped = "max_minutes"`) when this
        measurement gives its stages more than it had (`--minutes` raised): its earlier runs here count against the
        new budget. So the same command reuses it, and a larger budget continues it from its checkpoint. None:
        nothing owed."""
        spent, had = self.seconds.get(stage), _json(self.budgets_path).get(stage)
        if stage in self.args.reuse_runs or state["stopped"] != "max_minutes" or spent is None or had is None:
            return None
        left = minutes - spent / 60
        return left if minutes > had and left >= 1 else None

    def _stage_problem(self, run: Path, state: dict[str, Any], start: str, record: dict[str, Any]) -> str | None:
        if record.get("cut_at_budget"):
            return f"killed at its budget of {self.args.minutes:g} minutes (rerun with the same --out to resume it)"
        if state["status"] != "finished":
            return f"status {state['status']}: {state['error'] or 'see ' + str(record.get('log'))}"
        if not state["export"]:
            return "no export (run.export = false?)"
        if state["held_out"] != self.held_out:
            return (f"its held-out split ({len(state['held_out'])} tasks) is not the benchmark's "
                    f"({len(self.held_out)}): it may have trained on an evaluated task")
        if state["model"] not in (None, start) and Path(state["model"]).resolve() != Path(start).resolve():
            return f"it started from {state['model']}, not {start}"
        if newer(Path(start) / "config.json", run / "config.toml"):
            return f"{start} was exported again after this run started from it: delete the run to train it again"
        return None

    def evaluate(self, arm: str) -> dict[str, Any] | None:
        """The arm's results document: reused when it matches (module docstring), else `shipyard eval`."""
        key = f"eval {arm}"
        given = self.args.reuse_evals.get(arm)
        path = Path(given) if given else self.out / "eval" / f"{arm}.json"
        model, engine = self.model_of(arm), self.engine_of(arm)
        doc = _json(path)
        why = eval_mismatch(doc, self.expected, None if given else engine) if doc else "missing"
        if why is None and not given and newer(Path(model) / "config.json", path):
            why = "its model was exported again after it"
        if given and why:
            self.failures.append(f"{key}: {path} is not this benchmark's evaluation: {why}")
            self.runs[key] = {"reused": str(path), "ok": False}
            return None
        if why is None:
            seconds = self.seconds.get(key) if not given else None
            self.runs[key] = {"reused": str(path), "seconds": seconds or doc.get("wall_seconds"), "ok": True}
            return doc
        rollouts = path.with_suffix(".rollouts.jsonl")
        resumed = doc == {} and journal_usable(rollouts, self.expected, model, engine)
        if not resumed:
            rollouts.unlink(missing_ok=True)  # another model's or settings' rollouts: eval refuses to mix them
        path.unlink(missing_ok=True)
        command = eval_command(self.config, self.tasks, engine, self.held_out, self.args.samples,
                               self.args.concurrency, path)
        log = self.out / "eval" / f"{arm}.log"
        record = run_stage(key, command + (["--resume"] if resumed else []), log, None, lambda: len(_lines(rollouts)),
                           len(self.held_out) * self.args.samples, self.env)
        if resumed and record["returncode"] == 2:  # eval refused the journal (its own settings check): start over
            rollouts.unlink(missing_ok=True)
            resumed = False
            record = run_stage(key, command, log, None, lambda: len(_lines(rollouts)),
                               len(self.held_out) * self.args.samples, self.env)
        record = self.ran(key, record, resumed)
        doc = _json(path)
        if record["returncode"] != 0 or not doc:
            self.failures.append(f"{key}: `shipyard eval` exited {record['returncode']} (see {record['log']})")
            self.runs[key] = {**record, "ok": False}
            return None
        self.runs[key] = {**record, "ok": True}
        return doc


def sampler(choice: str, config) -> str:
    """The engine that samples every arm (`--engine`): `vllm` or `local`. `auto` is vLLM wherever its venv is
    installed ([vllm] python): it is the faster sampler here (docs/benchmarks.md, "vLLM as the loop's sampler")."""
    from shipyard.models.vllm_server import require_python, runnable

    installed = runnable(config.vllm.python)
    if choice == "vllm":
        require_python(config.vllm.python, "--engine vllm: [vllm] python", "set --vllm.python")
    return "vllm" if choice == "vllm" or (choice == "auto" and installed) else "local"


# Figures --------------------------------------------------------------------------------------------------------------
def effort(doc: dict[str, Any]) -> dict[str, Any]:
    """Tokens and turns per solved rollout (and per rollout) of an evaluation; null where nothing was solved."""
    scored = [r for r in doc.get("rollouts", []) if r.get("reward") is not None]
    solved = [r for r in scored if r["reward"] >= 1.0]

    def mean(rows: list[dict], key: str) -> float | None:
        return sum(r.get(key, 0) for r in rows) / len(rows) if rows else None

    return {"solved_rollouts": len(solved), "scored_rollouts": len(scored),
            "solved_tasks": len({r["task"] for r in solved}), "tokens_per_solved": mean(solved, "sampled_tokens"),
            "turns_per_solved": mean(solved, "turns"), "tokens_per_rollout": mean(scored, "sampled_tokens"),
            "turns_per_rollout": mean(scored, "turns")}


def pass_figures(docs: dict[str, dict[str, Any]], resamples: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pass_at_1 per arm with its interval and its paired difference from base, delta_rl)."""
    rates = {arm: task_rates(doc) for arm, doc in docs.items()}
    out = {}
    for arm, r in rates.items():
        own = bootstrap_mean([r[t] for t in sorted(r) if r[t] is not None], resamples=resamples)
        vs = paired_difference(rates["base"], r, resamples=resamples) if "base" in rates else None
        out[arm] = {**own, "vs_base": vs}
    if "sft" in rates and "sft+rl" in rates:
        delta = paired_difference(rates["sft"], rates["sft+rl"], resamples=resamples)
    else:
        delta = {"mean": None, "ci95": None, "tasks": 0, "note": "needs the sft and sft+rl arms evaluated"}
    return out, delta


def _ci(figure: dict[str, Any] | None) -> str:
    if not figure or figure.get("ci95") is None:
        return "–"
    return f"[{figure['ci95'][0]:+.3f}, {figure['ci95'][1]:+.3f}]"


def plot(pass_at_1: dict[str, Any], delta_rl: dict[str, Any], curves: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if curves else 2, figsize=(15 if curves else 10, 4))
    for ax, rows, title in ((axes[0], {a: f for a, f in pass_at_1.items()}, "held-out pass@1 (95 % CI over tasks)"),
                            (axes[1], {**{f"{a} − base": f["vs_base"] for a, f in pass_at_1.items()
                                          if a != "base" and f.get("vs_base")}, "(sft+rl) − sft": delta_rl},
                             "paired differences (95 % CI)")):
        shown = {name: f for name, f in rows.items() if f and f.get("mean") is not None}
        means = [f["mean"] for f in shown.values()]
        errors = [[m - f["ci95"][0] for m, f in zip(means, shown.values(), strict=True)],
                  [f["ci95"][1] - m for m, f in zip(means, shown.values(), strict=True)]]
        bars = ax.bar(list(shown), means, yerr=errors, capsize=6, color="tab:blue", alpha=0.75)
        ax.bar_label(bars, labels=[f"{m:.3f}" for m in means], padding=2)
        ax.axhline(0, color="black", linewidth=0.8)
        if ax is axes[0]:  # a rate: from 0, with room above the highest interval
            ax.set_ylim(0, max([0.1, *(1.15 * f["ci95"][1] for f in shown.values())]))
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20)
        ax.grid(alpha=0.3, axis="y")
    if curves:
        for stage, values in curves.items():
            axes[2].plot(range(1, len(values) + 1), [v or 0.0 for v in values], marker="o", label=stage)
        axes[2].set_title("RL stages: grounded tool-call validity")
        axes[2].set_xlabel("training step")
        axes[2].legend()
        axes[2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(bench: Bench, docs: dict[str, dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """Print the tables and draw the plot; the figures of the JSON line."""
    pass_at_1, delta_rl = pass_figures(docs, bench.args.bootstrap)
    efforts = {arm: effort(doc) for arm, doc in docs.items()}
    n, samples = len(bench.held_out), bench.args.samples
    table(f"held-out pass@1 per arm ({n} tasks × {samples} samples; bootstrap 95 % intervals over tasks, paired by "
          f"task for differences)", ["arm", "pass@1", "95% CI", "vs base", "95% CI", "solved / scored", "tasks"],
          [[a, f["mean"], _ci(f), (f["vs_base"] or {}).get("mean"), _ci(f["vs_base"]),
            f"{efforts[a]['solved_rollouts']} / {efforts[a]['scored_rollouts']}", f["tasks"]]
           for a, f in pass_at_1.items()])
    shown = "–" if delta_rl["mean"] is None else f"{delta_rl['mean']:+.3f} {_ci(delta_rl)}"
    console.print(f"delta_rl = (sft+rl) − sft: {shown} over {delta_rl['tasks']} tasks {delta_rl.get('note', '')}")
    table("effort per arm (held-out rollouts)", ["arm", "solved tasks", "tokens/solved", "turns/solved",
                                                 "tokens/rollout", "turns/rollout"],
          [[a, e["solved_tasks"], e["tokens_per_solved"], e["turns_per_solved"], e["tokens_per_rollout"],
            e["turns_per_rollout"]] for a, e in efforts.items()])
    stages = {name: r.get("seconds") for name, r in bench.runs.items()}
    table("stages", ["stage", "minutes", "status", "steps", "note"],
          [[name, r["seconds"] / 60 if r.get("seconds") is not None else None, "ok" if r["ok"] else "FAILED",
            r.get("steps", ""), r.get("problem") or ("reused " + r["reused"] if "reused" in r else r.get("log", ""))]
           for name, r in bench.runs.items()])
    png = bench.out / "learning.png"
    curves = {s: r["grounded"] for s, r in bench.runs.items() if s in STAGES and STAGES[s][0] == "train"
              and r.get("grounded")}
    plot(pass_at_1, delta_rl, curves, png)
    return {"pass_at_1": pass_at_1, "delta_rl": delta_rl, "stages": stages, "effort": efforts, "plot": str(png),
            "arms": arms, "engine": bench.engine, "held_out": bench.held_out, "samples": samples,
            "config": str(bench.args.config),
            "tasks": str(bench.tasks), "runs": bench.runs, "failures": bench.failures}


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    from shipyard.rl.demo import REPO

    p = argparse.ArgumentParser(prog="shipyard bench learning", allow_abbrev=False,
                                epilog="Other --SECTION.KEY VALUE arguments override the configuration.")
    p.add_argument("--config", type=Path, default=REPO / "configs" / "learning.toml")
    p.add_argument("--arms", default="base,sft,sft+rl", help=f"among {', '.join(ARMS)}")
    p.add_argument("--samples", type=int, default=2, help="evaluation samples per held-out task")
    p.add_argument("--minutes", type=float, default=360.0, help="wall-time budget of each training stage")
    p.add_argument("--eval-reserve", type=float, default=None,
                   help="minutes of an RL stage's budget kept for its own final eval and checkpoint (default: a "
                        "quarter of --minutes, at most 90)")
    p.add_argument("--concurrency", type=int, default=4, help="episodes at once in each evaluation")
    p.add_argument("--engine", choices=("auto", "local", "vllm"), default="auto",
                   help="what samples the evaluations and the RL stages: vllm (a vLLM server from [vllm] python), "
                        "local (in this process), auto (vllm where [vllm] python is installed)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--sft-args", default="", help="overrides for the SFT stage only, one string")
    p.add_argument("--rl-args", default="", help="overrides for the RL stages only, one string")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--reuse", action="append", default=[], metavar="ARM=PATH",
                   help="a finished run directory as the arm's stage, or a results FILE.json as its evaluation")
    args, overrides = p.parse_known_args(argv)
    if not args.minutes > 0 or args.samples < 1 or args.concurrency < 1 or args.bootstrap < 1:
        p.error("--minutes, --samples, --concurrency and --bootstrap must be positive")
    args.eval_reserve = min(90.0, args.minutes / 4) if args.eval_reserve is None else args.eval_reserve
    if not 0 <= args.eval_reserve < args.minutes:
        p.error(f"--eval-reserve must be at least 0 and less than --minutes ({args.minutes:g})")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    reuse = [item.split("=", 1) for item in args.reuse]
    if not args.arms or set(args.arms) - set(ARMS) or any(len(r) != 2 or r[0] not in ARMS for r in reuse):
        p.error(f"--arms and --reuse ARM=PATH name arms among {', '.join(ARMS)}")
    missing = [f"{arm}={path}" for arm, path in reuse if not Path(path).exists()]
    if missing:
        p.error(f"--reuse {missing[0]}: no such run directory or results file")
    args.reuse_runs = {arm: path for arm, path in reuse if Path(path).is_dir()}
    args.reuse_evals = {arm: path for arm, path in reuse if not Path(path).is_dir()}
    if "base" in args.reuse_runs:
        p.error("the base arm has no training stage: --reuse base=FILE.json reuses its evaluation")
    args.out = args.out or Path.home() / ".cache" / "shipyard" / f"bench-learning-{time.strftime('%Y%m%d-%H%M%S')}"
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(argv)
    bench = Bench(args, overrides)
    console.print(f"[bold]bench learning[/]: arms {', '.join(args.arms)} on {len(bench.held_out)} held-out tasks × "
                  f"{args.samples} samples, sampled by the {bench.engine} engine; out {args.out}")
    args.out.mkdir(parents=True, exist_ok=True)
    docs = {}
    for arm in args.arms:
        if arm != "base" and not bench.stage(arm):
            continue
        doc = bench.evaluate(arm)
        if doc is not None:
            docs[arm] = doc
    figures = report(bench, docs, args.arms)
    (args.out / "learning.json").write_text(json.dumps(figures, indent=1) + "\n")
    if bench.failures:
        console.print("[bold red]the measurement is incomplete:[/] " + "; ".join(bench.failures), soft_wrap=True)
    finish("learning", figures)
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
