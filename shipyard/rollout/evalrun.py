"""Running an evaluation (`shipyard eval`, the benchmarks' arms, SFT's gold replays), and resuming one that stopped.

`run_eval` runs `samples` rollouts of each task through the shared scheduler (`Scheduler.evaluate`) and returns the
results document of `shipyard.rollout.eval.results`. With a rollouts file, each rollout is appended there as it
ends (one JSON line, trajectory included), so the file is the eval's journal.

**Resuming.** An evaluation of a held-out split with a 0.5B model on 2 cores takes hours; a machine that is needed
for something else, a session that ends, a killed process must not cost the rollouts already finished. Rollout i of
task T always samples with `rollout_seed(seed, T, i)`, so a finished rollout is exactly what a rerun would draw
(given the same weights, settings and engine arithmetic), and an eval resumed from its journal is the same
experiment as one run through. `run_eval(..., resume=True)` keeps every *scored* rollout of the journal whose task
is evaluated, whose index is below `samples` and whose seed is the one this eval would draw for it, and runs only the
rest. Masked rollouts (infrastructure failures, cancellations) are run again: they carry no result.

What a rollout depends on besides its seed — the model and the engine serving it, the run seed, the task set, the
episode's settings (turns, tokens, temperature, wire, grading timeout, search), the attempt's time budget — is written
beside the journal when it is started (`JOURNAL.settings.json`, `settings_path`). A resume with other settings is
refused (`UsageError`, naming each difference) rather than mixing two experiments in one figure; so is a journal
without its settings. A line cut
short by a kill mid-write (the last line, without its newline) is dropped and the file truncated before it, so the
next append starts a whole line; a malformed line anywhere else is a `FileFormatError`. Without `resume`, a journal
that already holds rollouts is refused too: appending a second eval to it would mix them silently.

What a resume cannot see: weights changed in place under the same model path. The caller that owns the model's
directory (the learning benchmark) compares its export's time with the journal's and starts over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shipyard.errors import UsageError
from shipyard.rollout.eval import Progress, default_ks, results
from shipyard.rollout.record import Rollout, read_rollout_lines, rollout_seed

RESUMED_KEYS = ("model", "engine", "seed", "tasks_dir", "episode", "rollout_time_budget")  # equal, or no resume


@dataclass
class EvalConfig:
    """What an eval runs (the episode itself is configured by `shipyard.rollout.episode.episode_config`)."""

    samples: int = 1  # rollouts per task (one group)
    ks: list[int] | None = None  # pass@k reported for these k (default: `default_ks(samples)`)
    seed: int = 0  # the run seed: rollout i of task T samples with `rollout_seed(seed, T, i)`
    concurrency: int = 4  # episodes at once
    max_infra_retries: int = 2  # attempts after an infrastructure failure (same seed), then masked
    rollout_time_budget: float | None = None  # seconds per attempt; past it the rollout is cancelled (masked)

    def __post_init__(self) -> None:
        if self.samples < 1 or self.concurrency < 1:
            raise UsageError(f"samples and concurrency must be at least 1, got {self.samples} and {self.concurrency}")
        ks = self.ks if self.ks is not None else default_ks(self.samples)
        bad = [k for k in ks if not 1 <= k <= self.samples]
        if bad:
            raise UsageError(f"pass@k needs 1 <= k <= samples ({self.samples}); got k = {bad[0]}")
        self.ks = sorted(set(ks))


def settings_path(journal: Path) -> Path:
    """Where the settings of the eval journalled in `journal` are kept."""
    return journal.with_name(journal.name + ".settings.json")


def _json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _cut_torn_line(journal: Path) -> None:
    """Truncate `journal` after its last newline: a line without one was cut short mid-write."""
    data = journal.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(journal, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)


def finished(journal: Path, settings: Mapping[str, Any], task_ids: list[str], config: EvalConfig) \
        -> dict[tuple[str, int], Rollout]:
    """The rollouts of `journal` that this eval keeps on a resume (module docstring), by (task, index). UsageError
    when the journal was written with other settings or without its settings file."""
    if not journal.exists() or journal.stat().st_size == 0:
        return {}
    where = settings_path(journal)
    try:
        before = json.loads(where.read_text())
        if not isinstance(before, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        raise UsageError(f"{journal} holds rollouts but not the settings they ran with ({where} is missing): it cannot "
                         f"be resumed; remove it to evaluate from the start") from None
    except ValueError as e:
        raise UsageError(f"{where} is not JSON ({e}): remove {journal} and it to evaluate from the start") from None
    now = _json_safe(dict(settings))
    differ = [f"{k}: {before.get(k)!r} there, {now.get(k)!r} here" for k in RESUMED_KEYS if before.get(k) != now.get(k)]
    if differ:
        raise UsageError(f"{journal} was written by an eval with other settings — " + "; ".join(differ)
                         + ": resume it with the same ones, or give another --rollouts file")
    _cut_torn_line(journal)
    wanted = set(task_ids)
    kept: dict[tuple[str, int], Rollout] = {}
    for rollout in read_rollout_lines(journal):
        key = (rollout.task_id, rollout.index)
        if (rollout.task_id in wanted and rollout.index < config.samples and not rollout.masked
                and rollout.seed == rollout_seed(config.seed, rollout.task_id, rollout.index)):
            kept.setdefault(key, rollout)
    return kept


def run_eval(engine, env, tasks_dir: Path, task_ids: list[str], episode, config: EvalConfig, *,
             progress: Progress | None = None, describe: Mapping[str, Any] | None = None,
             rollouts_path: Path | None = None, resume: bool = False) -> dict[str, Any]:
    """Run `config.samples` rollouts of each task through the shared scheduler (`Scheduler.evaluate` over an
    `InProcessTransport` of `engine` and `env`, episodes configured by `episode`, an `EpisodeConfig`) and return the
    results document (`results`). The caller owns `engine` and `env` (and closes them). `describe` is added to the
    document's `config` (the model's name, the task set, …). `progress` hears each rollout as it ends (and, on a
    resume, each one kept first); with `rollouts_path`, each is also appended there as one JSON line, trajectory
    included (`Rollout.to_json`). `resume` keeps the finished rollouts already there (module docstring)."""
    settings = {"model": (describe or {}).get("model"), "engine": (describe or {}).get("engine"), "seed": config.seed,
                "tasks_dir": str(Path(tasks_dir).resolve()), "episode": asdict(episode),
                "rollout_time_budget": config.rollout_time_budget}
    kept: dict[tuple[str, int], Rollout] = {}
    with contextlib.ExitStack() as stack:
        if rollouts_path is not None:
            stack.enter_context(_only_writer(rollouts_path))
            kept = _opened(rollouts_path, settings, task_ids, config, resume)
        return _run(engine, env, tasks_dir, task_ids, episode, config, progress, describe, rollouts_path, kept)


def _opened(rollouts_path: Path, settings: dict, task_ids: list[str], config: EvalConfig, resume: bool) \
        -> dict[tuple[str, int], Rollout]:
    """The journal made ready for this eval: what a resume keeps of it, and its settings written beside it."""
    kept: dict[tuple[str, int], Rollout] = {}
    if resume:
        kept = finished(rollouts_path, settings, task_ids, config)
    elif rollouts_path.stat().st_size:
        raise UsageError(f"{rollouts_path} already holds rollouts: resume that eval (`shipyard eval --resume`), "
                         f"or give another file")
    settings_path(rollouts_path).write_text(json.dumps(_json_safe(settings), indent=1) + "\n")
    return kept


@contextlib.contextmanager
def _only_writer(journal: Path) -> Iterator[None]:
    """Hold an exclusive lock on `journal` while this eval writes it: a second eval of it — an orphaned one still
    running, say — would interleave its lines with this one's, or cut them as torn."""
    journal.parent.mkdir(parents=True, exist_ok=True)
    with open(journal, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"{journal} is being written by another eval that is still running: wait for it to end, "
                             "or stop it, then resume") from None
        yield


def _run(engine, env, tasks_dir: Path, task_ids: list[str], episode, config: EvalConfig,
         progress: Progress | None, describe: Mapping[str, Any] | None, rollouts_path: Path | None,
         kept: dict[tuple[str, int], Rollout]) -> dict[str, Any]:
    import asyncio

    from shipyard.rollout.record import append_jsonl
    from shipyard.rollout.scheduler import Scheduler, SchedulerConfig
    from shipyard.rollout.transport import InProcessTransport

    if progress is not None:
        for rollout in kept.values():
            progress(rollout)

    def ended(rollout: Rollout) -> None:
        if rollouts_path is not None:
            append_jsonl(rollouts_path, [rollout.to_json()])
        if progress is not None:
            progress(rollout)

    transport = InProcessTransport(engine, env, episode, workers=config.concurrency)
    scheduler = Scheduler(SchedulerConfig(group_size=config.samples, run_seed=config.seed, dynamic_sampling=False,
                                          max_infra_retries=config.max_infra_retries,
                                          rollout_time_budget=config.rollout_time_budget),
                          transport, tasks_dir)

    async def evaluate() -> dict[str, list[Rollout]]:
        try:
            return await scheduler.evaluate(task_ids, config.samples, ended, done=kept)
        finally:
            await scheduler.close()

    start = time.monotonic()
    groups = asyncio.run(evaluate())
    loop = episode.loop
    described = {**dict(describe or {}), "samples": config.samples, "seed": config.seed,
                 "concurrency": config.concurrency, "max_infra_retries": config.max_infra_retries,
                 "rollout_time_budget": config.rollout_time_budget, "grade_timeout": episode.grade_timeout,
                 "loop": asdict(loop), "task_ids": list(task_ids), "resumed_rollouts": len(kept)}
    wall = time.monotonic() - start
    doc = results(groups, list(config.ks), config=described, wall_seconds=wall, scheduler_stats=scheduler.stats())
    if kept:  # the rate of the rollouts run now, not of those kept from before
        doc["overall"]["rollouts_per_hour"] = round(scheduler.counters["finished"] * 3600 / wall, 2) if wall else None
    return doc
