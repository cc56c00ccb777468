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
is checked against it, so no stage trained on an evaluated task), with the same samples, under the configuration tree
itself (`shipyard eval --config`, the tree written beside the results as ARM.config.toml): the stages' `[episode]`
(every `[episode.loop]` field, `grade_timeout`), `[run] seed` and `[vllm]` servers. One evaluation path for all arms:
what differs between arms is the weights, nothing else.

**Budgets.** Each training stage gets `--minutes` of wall time in all: `shipyard train` and `shipyard sft` stop
themselves after the step that reaches the budget less `--eval-reserve` (`run.max_minutes`) and checkpoint; a stage
still running at the budget is killed, reported as such, and fails the measurement. The wall time of a stage's
earlier runs in OUT (`stages.json`) counts against its budget — a run that died with the benchmark (a session
ended) up to its last recorded step (`running.json` marks a run while it runs) — and a run is started only when
what is left holds another of its longest steps (`Bench.plan`). So a stage that stopped itself at its budget is
reused by the same command and continued from its checkpoint by a larger `--minutes` (`budgets.json` keeps the
budget each stage last ran under), and a killed stage is resumed with what is left, or refused until `--minutes`
grows. A stage that started from an export written again since (its parent trained again) is stale: refused before
it is reused or resumed. Evaluations run to their end.

**Cost.** The RL stages run with `--run.evaluate false`: the benchmark evaluates every arm itself, the same way, so
the runs' own before/after evaluations would be the same work twice.

**Resuming.** A long measurement is resumed stage by stage: run the same command with the same `--out`. A training stage
whose run directory there is finished (with an export) is reused, an unfinished one continues from its last checkpoint
(`--run.resume true`) within its budget (above), and an arm's evaluation file there is reused when it evaluated the same
model, tasks, samples, seed and episode settings. An evaluation that was stopped goes on from its journal
(`ARM.rollouts.jsonl`, `shipyard eval --resume`): its finished rollouts are kept when the journal's settings are this
arm's and its model was not exported again since. `--reuse ARM=DIR` uses a finished run elsewhere as the arm's stage,
`--reuse ARM=FILE.json` an evaluation elsewhere as the arm's results (checked the same way, but for the model).

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
import shlex
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from rich.markup import escape

from shipyard.bench._common import console, finish, status, table
from shipyard.bench._stages import ci_text, newer, read_json, read_lines, run_stage, run_state, write_json
from shipyard.errors import UsageError
from shipyard.harness.loop import LoopConfig
from shipyard.rollout.eval import bootstrap_mean, paired_difference, task_rates

ARMS = ("base", "sft", "sft+rl", "rl", "sft+rl+hints")
# stage → (command, the stage whose export it starts from (None: the base model), its own overrides)
NO_EVAL = ["--run.evaluate", "false"]  # the benchmark evaluates every arm itself, the same way
STAGES: dict[str, tuple[str, str | None, list[str]]] = {
    "sft": ("sft", None, []), "sft+rl": ("train", "sft", NO_EVAL), "rl": ("train", None, NO_EVAL),
    "sft+rl+hints": ("train", "sft", [*NO_EVAL, "--hints.enabled", "true"])}
# the episode settings two evaluations (and a stage and its evaluation) are compared on: every [episode.loop] field
# but the seed, which each rollout's spec replaces
LOOP_SETTINGS = tuple(f.name for f in fields(LoopConfig) if f.name != "seed")


def episode_settings(grade_timeout: Any, loop: dict[str, Any]) -> dict[str, Any]:
    """The episode settings compared, from a grading budget and an [episode.loop] as a record holds it (None where it
    lacks a field)."""
    return {"grade_timeout": grade_timeout, **{k: loop.get(k) for k in LOOP_SETTINGS}}


def eval_settings(config, held_out: list[str], samples: int) -> dict[str, Any]:
    """What two evaluations must share to be compared (as a results document's `config` records it)."""
    return {"task_ids": sorted(held_out), "samples": samples, "seed": config.run.seed,
            **episode_settings(config.episode.grade_timeout, asdict(config.episode.loop))}


def episode_differences(loop: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The LOOP_SETTINGS in which a stage's episodes (`loop`: [episode.loop] as its config records it) differ from
    the evaluations' (`expected`, `eval_settings`)."""
    return [f"{k} {loop.get(k)!r} (evaluations: {expected[k]!r})" for k in LOOP_SETTINGS if loop.get(k) != expected[k]]


def eval_command(config, tasks: Path, model: str, held_out: list[str], samples: int, concurrency: int,
                 out: Path) -> list[str]:
    """`shipyard eval` of `model` (an engine's name: `vllm:DIR` samples on a vLLM server) under the configuration
    tree itself, written beside `out` (OUT.config.toml): the training stages' episodes, [run] seed, [engine] device
    and [vllm] servers."""
    from shipyard.rl.config import save_config

    tree = save_config(config, out.with_suffix(".config.toml"), note=f"the configuration of {out.name}'s evaluation")
    return [sys.executable, "-m", "shipyard.cli", "eval", "--tasks", str(tasks), "--model", model,
            *(x for t in held_out for x in ("--task", t)), "--samples", str(samples), "--concurrency",
            str(concurrency), "--config", str(tree), "--out", str(out), "--rollouts",
            str(out.with_suffix(".rollouts.jsonl"))]


def journal_usable(journal: Path, expected: dict[str, Any], model: str, engine: str) -> bool:
    """Whether the stopped evaluation journalled in `journal` is this arm's (its settings file, `shipyard.rollout.
    evalrun.settings_path`, names the same model, `engine` its name as given to `shipyard eval`, and the same episode
    settings; the model not exported again since)."""
    from shipyard.rollout.evalrun import settings_path

    settings = read_json(settings_path(journal))
    episode = settings.get("episode", {})
    seen = episode_settings(episode.get("grade_timeout"), episode.get("loop", {}))
    return (journal.is_file() and settings.get("model") == engine and not newer(Path(model) / "config.json", journal)
            and all(seen[k] == expected[k] for k in seen))


def eval_mismatch(doc: dict[str, Any], expected: dict[str, Any], model: str | None) -> str | None:
    """Why an existing results document is not this arm's evaluation (None: it is)."""
    c = doc.get("config", {})
    seen = {"task_ids": sorted(c.get("task_ids", [])), "samples": c.get("samples"), "seed": c.get("seed"),
            **episode_settings(c.get("grade_timeout"), c.get("loop", {}))}
    if model is not None:
        seen["model"], expected = c.get("model"), {**expected, "model": model}
    wrong = [f"{k} {seen[k]!r} (here {v!r})" for k, v in expected.items() if seen[k] != v]
    return "; ".join(wrong) or None


class Bench:
    """One measurement: the configuration, its held-out split, and the stages and evaluations run or reused."""

    def __init__(self, args: argparse.Namespace, overrides: list[str]) -> None:
        from shipyard.rl.build import split, task_set
        from shipyard.rl.config import load_config

        self.args, self.overrides, self.out = args, overrides, args.out
        self.config = load_config(args.config, ["--run.dir", str(self.out), *overrides])
        for flag, extra in (("--sft-args", args.sft_args), ("--rl-args", args.rl_args)):
            if not extra:
                continue
            stage = load_config(args.config, ["--run.dir", str(self.out), *overrides, *shlex.split(extra)])
            differ = episode_differences(asdict(stage.episode.loop), asdict(self.config.episode.loop))
            if differ:
                raise UsageError(f"{flag} changes the stage's episodes ([episode.loop] {', '.join(differ)}): every "
                                 f"arm is evaluated with the episodes it trained with; give episode settings in the "
                                 f"configuration or as the benchmark's own overrides")
        self.tasks = task_set(self.config, status)
        self.held_out = sorted(split(self.config, self.tasks)[1])
        self.expected = eval_settings(self.config, self.held_out, args.samples)
        self.engine = sampler(args.engine, self.config)
        self.runs: dict[str, dict[str, Any]] = {}  # stage or "eval ARM" → what happened
        self.failures: list[str] = []
        self.seconds_path = self.out / "stages.json"  # wall seconds of what ran here, kept for a resumed measurement
        self.seconds: dict[str, float] = read_json(self.seconds_path)
        self.budgets_path = self.out / "budgets.json"  # the steps' budget (minutes) each stage here last ran under
        self.open_path = self.out / "running.json"  # stage → when its run began, while it runs

    def ran(self, key: str, record: dict[str, Any], resumed: bool = False) -> dict[str, Any]:
        """Note the wall time of a stage run here (a resumed stage adds to what its earlier runs took)."""
        self.note_seconds(key, (self.seconds.get(key, 0.0) if resumed else 0.0) + record["seconds"])
        self.opened(key, None)
        return {**record, "seconds": self.seconds[key]}

    def note_seconds(self, key: str, seconds: float) -> None:
        self.seconds[key] = seconds
        write_json(self.seconds_path, self.seconds)

    def opened(self, key: str, since: float | None) -> None:
        """Mark a stage run as begun here at `since` (None: it ended and `stages.json` holds its time). A mark left
        behind means this benchmark died with the run (a session ended): `spent` then counts the run up to its last
        recorded step."""
        marks = {k: v for k, v in read_json(self.open_path).items() if k != key}
        if since is not None:
            marks[key] = since
        write_json(self.open_path, marks)

    def spent(self, stage: str, state: dict[str, Any]) -> float | None:
        """Seconds a stage's runs here took, a run this benchmark did not see end included (its time up to the run's
        last update); None when nothing says."""
        seconds = self.seconds.get(stage)
        since = read_json(self.open_path).get(stage)
        if since is not None and state["updated"] is not None:
            return (seconds or 0.0) + max(0.0, state["updated"] - since)
        if seconds is None and state["recorded_seconds"] is not None:
            return state["recorded_seconds"]  # a run begun before marks were kept: its own record
        return seconds

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
        stale = self.stale(run, state, start)
        action, minutes, note = ("stale", 0.0, stale) if stale else self.plan(stage, run, state)
        if action == "reuse":
            seconds = state["recorded_seconds"] if stage in a.reuse_runs else self.seconds.get(stage)
            record = {"reused": str(run), "seconds": seconds, **({"note": note} if note else {})}
        elif action in ("stale", "spent"):
            record = {"seconds": self.seconds.get(stage), "refused": note}
        else:
            per_stage = shlex.split(a.sft_args if command == "sft" else a.rl_args)
            resumed = (run / "run.json").exists()
            if resumed and (spent := self.spent(stage, state)) is not None:
                self.note_seconds(stage, spent)  # fold a run that died unseen into the stage's time
            self.opened(stage, time.time())
            cmd = [sys.executable, "-m", "shipyard.cli", command, str(a.config), *self.overrides, *per_stage,
                   "--run.dir", str(run), "--run.tasks", str(self.tasks), "--model.name", start,
                   "--run.max_minutes", f"{minutes:.2f}", *extra,
                   *(["--engine.kind", self.engine] if command == "train" else []),
                   *(["--run.resume", "true"] if resumed else [])]
            record = run_stage(stage, cmd, self.out / f"{stage}.log", minutes + a.eval_reserve,
                               lambda: run_state(run)["steps"], self.config.run.steps if command == "train" else None)
            record = {**self.ran(stage, record, resumed), "deadline_minutes": minutes + a.eval_reserve}
            budgets = {**read_json(self.budgets_path), stage: a.minutes - a.eval_reserve}
            write_json(self.budgets_path, budgets)
            state = run_state(run)
        why = record.get("refused") or self._stage_problem(state, start, record)
        self.runs[stage] = {**record, **{k: state[k] for k in ("status", "stopped", "steps", "grounded")},
                            "budget_minutes": a.minutes - a.eval_reserve, "ok": why is None,
                            **({"problem": why} if why else {})}
        if why:
            self.failures.append(f"{stage}: {why}")
        return why is None

    def plan(self, stage: str, run: Path, state: dict[str, Any]) -> tuple[str, float, str | None]:
        """What to do with a stage: ("reuse" | "run" | "spent", minutes its steps may take, a note). `--minutes`
        less `--eval-reserve` is the stage's budget in all: the wall time of its earlier runs here (`stages.json`)
        counts against it, and a run is only started when what is left holds another of its longest steps (a step
        that started always ends, so less would be killed). A stage that stopped itself at its budget is reused by the
        same command and continued by a larger budget than the one it last ran under (`budgets.json`; before that file,
        the run's own `run.max_minutes`)."""
        budget = self.args.minutes - self.args.eval_reserve
        if stage in self.args.reuse_runs:
            return "reuse", 0.0, None
        if not (run / "run.json").exists():
            return "run", budget, None
        had = read_json(self.budgets_path).get(stage, state["max_minutes"])
        spent = self.spent(stage, state)
        spent = spent / 60 if spent is not None else (had or 0.0)
        left, step = budget - spent, (state["longest_step"] or 0.0) / 60 + 1
        done = state["status"] == "finished" and state["export"]
        if done and state["stopped"] != "max_minutes":
            return "reuse", 0.0, None
        if done:
            if had is not None and budget <= had:
                return "reuse", 0.0, (f"stopped at its budget of {had:g} minutes, more than this run's {budget:g}"
                                      if budget < had else None)
            if left < step:
                return "reuse", 0.0, (f"stopped at its budget; {left:.1f} more minutes hold no step of its (the "
                                      f"longest took {step - 1:.1f}): reused as it is")
            return "run", left, None
        if left < step:  # killed or failed, and nothing left to resume it with
            return "spent", 0.0, (f"its budget of {budget:g} minutes is spent ({spent:.1f} minutes in its runs here) "
                                  f"and it is not finished: raise --minutes to resume it")
        return "run", left, None

    def stale(self, run: Path, state: dict[str, Any], start: str) -> str | None:
        """Why a stage that started from `start` (a stage's export) is no longer what that stage made: the export was
        written again after the run began (its parent trained again). Checked before reusing or resuming it."""
        export = Path(start) / "config.json"
        if state["model"] not in (None, start) and Path(state["model"]).resolve() != Path(start).resolve():
            return None  # it did not start from `start` at all: `_stage_problem` says so
        if state["started"] is None or not export.is_file() or export.stat().st_mtime <= state["started"]:
            return None
        return f"{start} was exported again after this run started from it: delete {run} to train it again"

    def _stage_problem(self, state: dict[str, Any], start: str, record: dict[str, Any]) -> str | None:
        if record.get("cut_at_budget"):
            return (f"killed at its deadline of {record['deadline_minutes']:.1f} minutes (what was left of its budget "
                    f"plus --eval-reserve): raise --minutes and run the same command to resume it")
        if state["status"] != "finished":
            return f"status {state['status']}: {state['error'] or 'see ' + str(record.get('log'))}"
        if not state["export"]:
            return "no export (run.export = false?)"
        if state["held_out"] != self.held_out:
            return (f"its held-out split ({len(state['held_out'])} tasks) is not the benchmark's "
                    f"({len(self.held_out)}): it may have trained on an evaluated task")
        if state["model"] not in (None, start) and Path(state["model"]).resolve() != Path(start).resolve():
            return f"it started from {state['model']}, not {start}"
        differ = episode_differences(state["loop"], self.expected) if state["loop"] else []
        if differ:
            return f"its episodes are not the evaluations' ([episode.loop] {', '.join(differ)})"
        return None

    def evaluate(self, arm: str) -> dict[str, Any] | None:
        """The arm's results document: reused when it matches (module docstring), else `shipyard eval`."""
        key = f"eval {arm}"
        given = self.args.reuse_evals.get(arm)
        path = Path(given) if given else self.out / "eval" / f"{arm}.json"
        model, engine = self.model_of(arm), self.engine_of(arm)
        doc = read_json(path)
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
        record = run_stage(key, command + (["--resume"] if resumed else []), log, None,
                           lambda: len(read_lines(rollouts)), len(self.held_out) * self.args.samples)
        if resumed and record["returncode"] == 2:  # eval refused the journal (its own settings check): start over
            rollouts.unlink(missing_ok=True)
            resumed = False
            record = run_stage(key, command, log, None, lambda: len(read_lines(rollouts)),
                               len(self.held_out) * self.args.samples)
        record = self.ran(key, record, resumed)
        doc = read_json(path)
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


def behaviour(doc: dict[str, Any]) -> dict[str, Any]:
    """What an arm's agent did on the held-out tasks (its eval's `overall`): progress on the failing tests short of a
    pass, the tools it called, and how its episodes ended; nulls for a result file older than these counts."""
    overall = doc.get("overall", {})
    f2p = overall.get("fail_to_pass") or {}
    return {"fail_to_pass_mean": f2p.get("mean"), "fail_to_pass_some": f2p.get("some"),
            "calls_by_tool": overall.get("calls_by_tool"), "stop_reasons": overall.get("stop_reasons")}


def _top(counts: dict[str, int] | None, n: int) -> str | None:
    return None if counts is None else ", ".join(f"{k} {v}" for k, v in sorted(counts.items(),
                                                                             key=lambda kv: -kv[1])[:n])


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
          [[a, f["mean"], ci_text(f), (f["vs_base"] or {}).get("mean"), ci_text(f["vs_base"]),
            f"{efforts[a]['solved_rollouts']} / {efforts[a]['scored_rollouts']}", f["tasks"]]
           for a, f in pass_at_1.items()])
    shown = "–" if delta_rl["mean"] is None else f"{delta_rl['mean']:+.3f} {ci_text(delta_rl)}"
    console.print(f"delta_rl = (sft+rl) − sft: {shown} over {delta_rl['tasks']} tasks {delta_rl.get('note', '')}")
    table("effort per arm (held-out rollouts)", ["arm", "solved tasks", "tokens/solved", "turns/solved",
                                                 "tokens/rollout", "turns/rollout"],
          [[a, e["solved_tasks"], e["tokens_per_solved"], e["turns_per_solved"], e["tokens_per_rollout"],
            e["turns_per_rollout"]] for a, e in efforts.items()])
    behaviours = {arm: behaviour(doc) for arm, doc in docs.items()}
    table("what each arm did (held-out rollouts; fail-to-pass: the task's failing tests made to pass, mean fraction "
          "and rollouts with some but not all)", ["arm", "fail-to-pass", "some", "calls", "episodes ended"],
          [[a, b["fail_to_pass_mean"], b["fail_to_pass_some"], _top(b["calls_by_tool"], 5),
            _top(b["stop_reasons"], 3)] for a, b in behaviours.items()])
    stages = {name: r.get("seconds") for name, r in bench.runs.items()}
    table("stages", ["stage", "minutes", "status", "steps", "note"],
          [[name, r["seconds"] / 60 if r.get("seconds") is not None else None, "ok" if r["ok"] else "FAILED",
            r.get("steps", ""), r.get("problem") or ("reused " + r["reused"] if "reused" in r else r.get("log", ""))]
           for name, r in bench.runs.items()])
    png = bench.out / "learning.png"
    curves = {s: r["grounded"] for s, r in bench.runs.items() if s in STAGES and STAGES[s][0] == "train"
              and r.get("grounded")}
    plot(pass_at_1, delta_rl, curves, png)
    return {"pass_at_1": pass_at_1, "delta_rl": delta_rl, "stages": stages, "effort": efforts, "behaviour": behaviours,
            "plot": str(png),
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
    p.add_argument("--minutes", type=float, default=360.0, help="wall-time budget of each training stage, in all: "
                   "its earlier runs in --out count, and a larger budget continues a stage stopped at its own")
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
                  f"{args.samples} samples, sampled by the {bench.engine} engine; out {escape(str(args.out))}")
    args.out.mkdir(parents=True, exist_ok=True)
    docs = {}
    for arm in args.arms:
        if arm != "base" and not bench.stage(arm):
            continue
        doc = bench.evaluate(arm)
        if doc is not None:
            docs[arm] = doc
    figures = report(bench, docs, args.arms)
    write_json(args.out / "learning.json", figures)
    if bench.failures:
        console.print("[bold red]the measurement is incomplete:[/] " + "; ".join(bench.failures), soft_wrap=True)
    finish("learning", figures)
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
