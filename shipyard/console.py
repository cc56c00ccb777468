"""What the commands of the `shipyard` command line share: one-line errors for what a user can fix (a
`shipyard.errors.UserError`; any other exception is a bug and keeps its traceback), status lines,
progress bars, the help texts of options several commands take, and the long jobs shown with progress (an eval, a
training run, a synthesis). Only `shipyard/cli.py` imports this; the library never prints.
"""

from __future__ import annotations

import json
import sys
from contextlib import closing, contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from shipyard.errors import UserError
from shipyard.models.bundled import BUNDLED

console = Console(stderr=True)
out = Console()

MODEL_HELP = (f"Model: a bundled name ({', '.join(BUNDLED)}), a local directory, a .gguf file, a hub id, "
              "random:tiny, replay:FILE.jsonl, openai:BASE_URL, or vllm:MODEL (a vLLM server of MODEL started from "
              "$SHIPYARD_VLLM_PYTHON, default .venv-vllm/bin/python).")


@contextmanager
def user_errors():
    """A user's mistake (`UserError`) becomes one line, `error: …`, and exit status 2. Anything else passes through:
    a bug, printed with its traceback (status 1)."""
    try:
        yield
    except UserError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)  # "[vllm] python" is not markup
        raise typer.Exit(2) from None


def progress_bar(title: str, fields: str):
    """A long job's progress bar on stderr: title, bar, done/total, `fields`, elapsed time (rich column formats)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(title), BarColumn(), MofNCompleteColumn(), TextColumn(fields), TimeElapsedColumn(),
                    console=console)


def status_line(message: str, to: Console = console) -> None:
    """One dim line of what a long job is doing; `message` is text, never markup (a path or a test id may hold
    brackets: `[/tmp/x]` would be a closing tag)."""
    to.print(f"[dim]· {escape(message)}[/]")


def print_notes(notes) -> None:
    """The host's notes (a missing hardening, a fallback taken), one yellow line each."""
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(str(note))}", soft_wrap=True)


def print_hits(query: str, hits, as_json: bool) -> None:
    """`shipyard search`'s results on stdout: location, symbol and the first lines of each chunk, or one JSON object.
    Names and code come from the repository: printed as text, never as markup."""
    from rich.text import Text

    if as_json:
        out.print_json(json.dumps({"query": query, "results": [
            {"location": h.chunk.location, "symbol": h.chunk.symbol, "score": h.score, "semantic_rank": h.semantic_rank,
             "bm25_rank": h.bm25_rank} for h in hits]}))
        return
    for h in hits:
        out.print(Text(h.chunk.location, style="bold") + Text(f"  {h.chunk.symbol}" if h.chunk.symbol else "",
                                                              style="cyan"), soft_wrap=True)
        for n, line in enumerate(h.chunk.text.split("\n")[:4], h.chunk.start):
            out.print(f"{n:>6}  {line[:160]}", markup=False, highlight=False)
    if not hits:
        console.print("no results")


SEARCH_HELP = ("Offer the codebase_search tool (semantic code search; the bundled MiniLM embeds the code on first use, "
               "or a task's index from synthesis).")
UNTAGGED_HELP = ("Tool calls written without <tool_call> tags (bare or fenced JSON): 'reject' reports them as format "
                 "errors, 'accept' runs them (flagged in the trajectory). Default: the bundled model's recorded "
                 "setting ('accept' for all of them), else 'reject'. See docs/harness.md.")
TAGS_HELP = ("How the <tool_call> tags reach the model: 'token' (the tokenizer's tag tokens) or 'spelled' (ordinary "
             "tokens, for a model that never learned the tag token). Default: the bundled model's recorded setting, "
             "a trained export's own, else 'token'. See docs/harness.md.")


def compare_shown(a: Path, b: Path) -> tuple[dict, str]:
    """`shipyard eval --compare A B`: the comparison document and its table."""
    from shipyard.rollout import eval as evaluation

    doc = evaluation.compare(evaluation.load_results(a), evaluation.load_results(b))
    return doc, evaluation.compare_markdown(doc)


def eval_shown(tasks: Path, task: list[str] | None, model: str, run: dict, tree: Path | None, overrides: list[str],
               env_server: str | None, rollouts_path: Path | None, resume: bool) -> tuple[dict, str]:
    """`shipyard eval`: the tasks selected and the eval's settings checked; the configuration tree read (`tree`, or
    the defaults, with `overrides`: the episodes' [episode] with `model`'s wire settings unless set, [rollout]
    max_infra_retries and rollout_time_budget, [engine] device, [model] tokenizer, [vllm] for a vllm: server, [run]
    seed); the eval run with a progress bar (`run_eval_shown`). The results document and its table."""
    from dataclasses import replace

    from shipyard.rollout import eval as evaluation
    from shipyard.rollout.evalrun import EvalConfig
    from shipyard.rollout.setup import select_tasks

    config = EvalConfig(**run)
    task_ids = select_tasks(tasks, task)
    from shipyard.rl.config import load_config  # imports torch: after the checks above

    cfg = load_config(tree, overrides, policy=model)
    config = replace(config, seed=cfg.run.seed, max_infra_retries=cfg.rollout.max_infra_retries,
                     rollout_time_budget=cfg.rollout.rollout_time_budget)
    doc = run_eval_shown(tasks, task_ids, model, config, cfg.episode, env_server, cfg.engine.device,
                         cfg.model.tokenizer, rollouts_path, resume, vllm=cfg.vllm)
    return doc, evaluation.markdown(doc)


def finish_eval(doc: dict, table: str, out_path: Path | None, markdown_path: Path | None, baseline: Path | None,
                check: bool) -> None:
    """Write an eval's (or a comparison's) outputs, record the baseline in task set `baseline` if given, print the
    table; with `check`, exit 1 when no rollout could be scored."""
    from shipyard.rollout import eval as evaluation
    from shipyard.tasks.baseline import record

    with user_errors():
        evaluation.write_outputs(doc, table, out_path, markdown_path)
        if baseline is not None and doc["overall"]["scored"]:
            status_line(f"baseline recorded in {record(doc, baseline, doc['config']['model'])}")
    sys.stdout.write(table)
    sys.stdout.flush()
    if out_path is not None:
        status_line(f"results written to {out_path}")
    if check:
        try:
            evaluation.check_scored(doc)
        except evaluation.EvalFailed as e:
            console.print(f"[bold red]eval failed:[/] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(1) from None


def load_config_help(tree: Path | None) -> None:
    """`shipyard eval -- --help`: every field of the configuration tree as a --SECTION.KEY option, with its value in
    `tree` (or its default); exits 0."""
    from shipyard.rl.config import load_config

    load_config(tree, ["--help"], prog="shipyard eval [--config CONFIG.toml]")


def run_eval_shown(tasks: Path, task_ids: list[str], model: str, config, episode, env_server: str | None, device: str,
                   tokenizer: str | None, rollouts_path: Path | None, resume: bool = False, vllm=None) -> dict:
    """Open the engine and the environment, run the eval with a progress bar, close both (`shipyard.rollout.setup`)."""
    from shipyard.rollout.eval import passed
    from shipyard.rollout.evalrun import run_eval
    from shipyard.rollout.setup import SandboxesUnavailable, open_engine, open_environment

    with console.status(escape(f"loading model {model}")):
        engine = open_engine(model, tasks_dir=tasks, task_ids=task_ids, device=device, tokenizer=tokenizer,
                             status=status_line, loop=episode.loop, vllm=vllm)
    with closing(engine):
        try:
            env = open_environment(env_server)
        except SandboxesUnavailable as e:
            raise UserError(f"{e}; use --env-server URL") from None
        with closing(env), progress_bar("[bold]eval[/] {task.description}",
                                        "{task.fields[passed]} passed · {task.fields[infra]} masked") as bar:
            counts = {"passed": 0, "infra": 0}
            job = bar.add_task(escape(model), total=len(task_ids) * config.samples, **counts)

            def progress(rollout) -> None:
                counts["passed"] += passed(rollout)
                counts["infra"] += rollout.masked
                bar.update(job, advance=1, **counts)

            described = {"model": model, "tasks_dir": str(tasks.resolve()), "engine": engine.name,
                         "environment": env.name}
            return run_eval(engine, env, tasks, task_ids, episode, config, progress=progress,
                            rollouts_path=rollouts_path, resume=resume, describe=described)


def synth_shown(specs: list[str], out_dir: Path, config, skip_done: bool, pack: Path | None = None,
                check: bool = True) -> list:
    """`shipyard.tasks.pool.synthesize_specs` (or, with `pack`, `shipyard.tasks.pack.rebuild` with `specs` as its
    --repo sources) with a progress bar over every project's tasks, then one line per project: its tasks and
    headline figures; the reports."""
    from shipyard.tasks.pack import pack_size, rebuild
    from shipyard.tasks.pool import synthesize_specs

    total = pack_size(pack) if pack else config.max_tasks * len(specs)
    with progress_bar("[bold]validated tasks", "{task.fields[tried]} tried") as bar:
        job = bar.add_task("synth", total=total, tried=0)
        kw = {"log": lambda m: status_line(m, bar.console),  # the repository's test ids: text, never markup
              "progress": lambda a, t: bar.update(job, completed=a, tried=t), "skip_done": skip_done}
        reports = rebuild(pack, out_dir, config, specs, check, **kw) if pack else \
            synthesize_specs(specs, out_dir, config, **kw)
    for report in reports:
        console.print(f"[green]{len(report.accepted)} tasks[/] of "
                      + escape(f"{report.project} in {out_dir} — {json.dumps(report.headline())}"))
    return reports


def run_bench(name: str, args: list[str]) -> None:
    """Run the benchmark `shipyard.bench.NAME` as `python -m` would, with `args` as its command line."""
    import pkgutil
    import runpy
    import sys

    import shipyard.bench

    found = sorted(m.name for m in pkgutil.iter_modules(shipyard.bench.__path__) if not m.name.startswith("_"))
    if name not in found:
        raise UserError(f"no benchmark '{name}'; available: {', '.join(found)}")
    sys.argv = [name, *args]
    runpy.run_module(f"shipyard.bench.{name}", run_name="__main__", alter_sys=True)


def need(condition: bool, message: str) -> None:
    """A command's check of its own arguments: a `UserError` (one line, exit 2) with `message` unless `condition`."""
    if not condition:
        raise UserError(message)


EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}  # a command whose config keys follow it


def run_configured(shown, config: Path, args: list[str]):
    """`shipyard train|sft CONFIG [--SECTION.KEY VALUE …]`: the config tree with its overrides, run by `shown`
    (`train_shown`, `sft_shown`); (the config, its metrics lines). A mistake is one line and exit 2."""
    from shipyard.rl.config import load_config

    with user_errors():
        cfg = load_config(config, args)
        return cfg, shown(cfg, [str(config), *args])


def sft_shown(cfg, argv: list[str]) -> list[dict]:
    """Run a configured fine-tuning (`shipyard.rl.sft.sft`) with its steps shown; its metrics lines."""
    from shipyard.rl.sft import sft as run_sft

    with progress_bar("[bold]SFT steps", "{task.fields[last]}") as bar:
        job = bar.add_task("sft", total=None, last="")

        def on_step(step: int, line: dict) -> None:
            loss = line.get("train/sft_loss")
            bar.update(job, completed=step, last=f"epoch {line.get('sft/epoch')} loss={loss:.3g}"
                       if isinstance(loss, int | float) else "")

        return run_sft(cfg, argv=argv, status=lambda m: status_line(m, bar.console), on_step=on_step)


def check_shown(cfg, argv: list[str]) -> list[dict]:
    """`shipyard train --check`: the run's plan (`shipyard.rl.plan`) printed; starts nothing."""
    from shipyard.rl.plan import plan

    found = plan(cfg)
    out.print(f"[bold]shipyard train {escape(' '.join(argv))}[/] would start:", soft_wrap=True)
    for line in found.lines:
        out.print(f"  {line}", soft_wrap=True, markup=False)
    if found.missing_here:
        out.print("[yellow]this machine lacks, to run it:[/]")
        for line in found.missing_here:
            out.print(f"  - {line}", soft_wrap=True, markup=False)
    out.print("[green]configuration OK[/]")
    return []


def train_shown(cfg, argv: list[str]) -> list[dict]:
    """Run a configured training (`shipyard.rl.build.train`) under a progress bar; its metrics lines."""
    from shipyard.rl.build import train as run_training

    with progress_bar("[bold]trainer steps", "{task.fields[last]}") as bar:
        job = bar.add_task("train", total=cfg.run.steps, last="")

        def on_step(step: int, line: dict) -> None:
            shown = {k: line.get(k) for k in ("reward/mean", "tools/grounded_fraction", "train/loss")}
            bar.update(job, completed=step, last=" ".join(f"{k}={v:.3g}" for k, v in shown.items()
                                                         if isinstance(v, int | float)))

        return run_training(cfg, argv=argv, status=lambda m: status_line(m, bar.console), on_step=on_step)


