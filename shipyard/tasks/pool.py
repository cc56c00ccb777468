"""A task pool: feature-deletion tasks of several projects in one task set (`shipyard synth --repo … --repos FILE`).

RL learns only from tasks where the policy sometimes succeeds, and a held-out evaluation means something only on
projects trained on not at all; both need many tasks from many projects. So a task set can hold the synthesis of
several repositories (`shipyard.tasks.sources`: directories and sdists by name), each task naming its project
(`Task.project`), and training can hold whole projects out (`[run] held_out_projects`, `shipyard.rl.build`).

A list file (`read_list`, `shipyard synth --repos FILE`) holds one spec per line; `#` starts a comment and blank
lines are skipped; a relative directory is taken relative to the list file's own directory, so a committed list can
name `../examples/pocketlib`.

`synthesize` runs `Synthesizer` once per source, in order, into the same directory, up to `max_tasks` tasks each;
each run appends its tasks to `tasks.jsonl` and its report to `synth.json` under the project's name
(`taskset.append_project`). Every source is resolved (sdists fetched) and every project checked against the set
(`taskset.claim`: a project the set already holds tasks of is refused) before the first synthesis starts, so a bad
spec or a second synthesis of a project fails in seconds, not after an hour of another project's work. A run cut
short keeps the projects it finished: the same command with `skip_done` (`--skip-done`) finishes the rest.

The recipe of the pool the project trains on (its lists, `configs/pool.txt` and `configs/pool-heldout.txt`, and
the command) is in docs/tasks.md, "Task pool".
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from shipyard.errors import InputNotFound, UsageError
from shipyard.tasks.environment import EnvSetupError
from shipyard.tasks.report import SynthReport
from shipyard.tasks.sources import Source, SourceError, is_directory_spec, resolve
from shipyard.tasks.synth import SynthConfig, Synthesizer
from shipyard.tasks.taskset import Project, TaskSetConflict, claim

Log = Callable[[str], None]
MAX_LIST = 1 << 20  # bytes of a list file


def synthesize(sources: list[Source], out: Path, config: SynthConfig, log: Log = print,
               progress: Callable[[int, int], None] | None = None, skip_done: bool = False) -> list[SynthReport]:
    """Each source synthesized into the task set `out` (module docstring); the reports, in order. `progress` hears
    (tasks accepted, candidates tried) summed over the projects so far. With `skip_done`, a project the set already
    holds tasks of is skipped (finishing an interrupted build) rather than refused."""
    todo = [sources[i] for i in unclaimed([s.project for s in sources], out, skip_done, log)]
    reports: list[SynthReport] = []
    for source in todo:
        log(f"{source.project}: up to {config.max_tasks} tasks from {source.path}")
        try:
            report = Synthesizer(source.path, out, config, log=log, project=source.project,
                                 progress=None if progress is None else offset_progress(progress, reports)).run()
        except EnvSetupError as e:
            raise SourceError(f"{source.project}: {e}") from None
        log(f"{source.project}: {len(report.accepted)} tasks of {report.tried} tried")
        reports.append(report)
    return reports


def read_list(path: Path) -> list[str]:
    """The specs of the list file `path` (module docstring); relative directories made relative to its folder."""
    path = Path(path)
    if not path.is_file():
        raise InputNotFound(f"--repos {path} is not a file (one spec per line: a directory or name==version)")
    if path.stat().st_size > MAX_LIST:
        raise UsageError(f"--repos {path} is larger than {MAX_LIST >> 20} MiB; a list names repositories, one a line")
    specs = []
    for raw in path.read_text(errors="replace").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if is_directory_spec(line, path.parent) and not Path(line).expanduser().is_absolute():
            line = str(path.parent / line)
        specs.append(line)
    return specs


def specs_of(repos: Iterable[str], lists: Iterable[Path]) -> list[str]:
    """The specs of `shipyard synth`: each --repo, then each line of each --repos list file (`sources.read_list`)."""
    specs = [*repos, *(spec for path in lists for spec in read_list(path))]
    if not specs:
        raise UsageError("synth needs --repo (a directory or name==version) or --repos FILE")
    return specs


def synthesize_specs(specs: Iterable[str], out: Path, config: SynthConfig, log: Log = print,
                     progress: Callable[[int, int], None] | None = None, skip_done: bool = False) \
        -> list[SynthReport]:
    """`synthesize` over specs (`sources.resolve`: directories and `name==version`), sdists fetched into a temporary
    directory (removed after) through the configured index and `config.wheel_cache`."""
    with tempfile.TemporaryDirectory(prefix="shipyard-sources-") as work:
        sources = resolve(specs, Path(work), config.index_url, config.cache)
        return synthesize(sources, out, config, log, progress, skip_done)



def unclaimed(projects: list[Project], out: Path, skip_done: bool, log: Log = print) -> list[int]:
    """The positions of `projects` to make into the task set `out`: all of them, or with `skip_done` those it
    holds no tasks of yet (TaskSetConflict without it; UsageError when `out` is something other than a task set)."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "tasks.jsonl").exists())):
        raise UsageError(f"--out {out} exists and is not a task set; choose an empty or new directory")
    todo = []
    for i, project in enumerate(projects):
        try:
            claim(out, project)
        except TaskSetConflict:
            if not skip_done:
                raise
            log(f"{project}: the task set already holds its tasks; skipped")
            continue
        todo.append(i)
    return todo


def offset_progress(progress: Callable[[int, int], None], before: list[SynthReport]) -> Callable[[int, int], None]:
    """`progress` for one more project: its counts added to those of the projects `before` it."""
    accepted, tried = sum(len(r.accepted) for r in before), sum(r.tried for r in before)
    return lambda a, t: progress(accepted + a, tried + t)
