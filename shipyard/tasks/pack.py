"""Task packs: a task set as one small file, rebuilt on another machine in minutes instead of CPU hours.

A task set is large (each task's `snapshot/` holds the project and its `.venv`: gigabytes for a pool) and costly to
make (synthesis grades every candidate about eleven times: ~100 CPU-minutes a project, docs/tasks.md). What makes a
task is small: the project's release, the deletion (its gold patch, reversed), the tests that decide it, its
statement and differential cases. A pack holds exactly that, so a pool can be committed, shared or moved, and
rebuilt anywhere `shipyard synth` runs (`shipyard pack`, `shipyard synth --from`), the way SWE-bench ships task
instances rather than images.

**Format** (gzip-compressed JSON lines; `PACK_VERSION`):

    {"format": "shipyard-task-pack", "version": 1, "projects": P, "tasks": T}
    {"project": {"name", "version"}, "spec": "name==version", "commit": C, "synth": REPORT}   one per project,
    {"task": TASK_JSON, "gold": GOLD_PATCH, "differential": CASES or null}                   then its tasks

`commit` is the project's source commit as synthesis recorded it (`synth.source_commit`: for an sdist, a hash of
its files as copied). `synth` is the project's synthesis report (rejections, timings), kept for the record.

**Rebuilding** (`rebuild`) reuses synthesis's own steps (`Synthesizer.prepare_base`, `write_tests`, `scrub`,
`fresh_commit`, `finish`): each project's release is fetched (sha256-checked against the index) or taken from a
`--repo` directory of the same project, its environment prepared, and its source commit compared with the pack's,
so the code is the one the tasks were made from. Each task's tree is the base with its gold patch applied in
reverse; the patch is then taken again (`tree_diff`) and must equal the pack's byte for byte, so the rebuilt
snapshot is exactly the deleted tree synthesis validated. The test lists, statement and cases are the pack's.

**Trust.** A pack is input like a task directory (`taskset`): possibly edited or planted. Every task goes through
the task schema (`Task.save`'s checks) and the differential schema; the gold patch is parsed by the grader's parser
and may name only the project's Python source files, never a test file, the venv or a link (it is applied on the
host, with `git apply`, in a copy made for the purpose). The environment may differ from where the pack was made
(other dependency releases, another interpreter), so by default each rebuilt task is graded again: the empty patch
must fail as synthesis required (`synth.check_empty`) and the gold patch must pass once. A task that fails is left
out and named, its reason counted; the rest of the set is kept, and the command exits non-zero.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import from_json

from shipyard.errors import FileFormatError, InputNotFound, UsageError
from shipyard.harness.diff import tree_diff
from shipyard.sandbox.host import host
from shipyard.sandbox.snapshot import check_name, snapshot_of
from shipyard.tasks import differential
from shipyard.tasks.environment import VENV, EnvSetupError
from shipyard.tasks.grade import MAX_GOLD, grade, read_gold
from shipyard.tasks.patchparse import parse_patch
from shipyard.tasks.patchscan import is_test_config
from shipyard.tasks.pool import offset_progress, unclaimed
from shipyard.tasks.scrub import fresh_commit, scrub
from shipyard.tasks.sources import Source, SourceError, resolve
from shipyard.tasks.synth import Rejected, SynthConfig, Synthesizer, SynthReport, check_empty, copy_task_tree, cpu_used
from shipyard.tasks.taskset import (
    MAX_TASK_JSON,
    TASK,
    IndexEntry,
    Project,
    Task,
    TaskFormatError,
    index_entries,
    load_task,
    path_problem,
    schema_problem,
    synth_reports,
)

FORMAT = "shipyard-task-pack"
PACK_VERSION = 1
MAX_PACK = 1 << 30  # bytes of a pack, decompressed (a 160-task pool is a few MiB)
MAX_LINE = MAX_TASK_JSON + differential.MAX_DIFF_FILE + MAX_GOLD  # one task line: task.json, cases and gold patch
Log = Callable[[str], None]


class PackFormatError(FileFormatError):
    """A pack is not in the format `shipyard pack` writes; the message names the file, the line and the problem."""


@dataclass
class PackedTask:
    task: Task
    gold: str
    differential: differential.Differential | None


@dataclass
class PackedProject:
    project: Project
    spec: str
    commit: str
    synth: dict[str, Any]
    tasks: list[PackedTask]


def write_pack(tasks_dir: Path, out: Path) -> tuple[int, int]:
    """The task set `tasks_dir` as a pack at `out` (through a temporary file and a rename); (projects, tasks)."""
    tasks_dir, out = Path(tasks_dir), Path(out)
    entries = index_entries(tasks_dir)
    if not entries:
        raise InputNotFound(f"--tasks {tasks_dir} lists no tasks (no tasks.jsonl, or it is empty): pack a task set "
                            "made by `shipyard synth`")
    reports = synth_reports(tasks_dir)
    by_project: dict[str, list[tuple[Task, Path]]] = {}
    for entry in entries:
        task, task_dir = load_task(tasks_dir, entry.id)
        by_project.setdefault(task.project.name, []).append((task, task_dir))
    tmp = out.with_name(out.name + ".partial")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"format": FORMAT, "version": PACK_VERSION, "projects": len(by_project),
                            "tasks": len(entries)}) + "\n")
        for name, tasks in by_project.items():
            commits = {t.source.get("commit") for t, _ in tasks}
            if len(commits) != 1:
                raise TaskFormatError(f"the tasks of {name} in {tasks_dir} were made from {len(commits)} different "
                                      "sources; a pack holds one release of each project")
            project = tasks[0][0].project
            f.write(json.dumps({"project": asdict(project), "spec": f"{project.name}=={project.version}",
                                "commit": commits.pop(), "synth": reports.get(name, {})}) + "\n")
            for task, task_dir in tasks:
                gold = read_gold(task_dir)
                diff = differential.load(task_dir)
                f.write(json.dumps({"task": asdict(task), "gold": gold,
                                    "differential": None if diff is None else asdict(diff)}) + "\n")
    tmp.replace(out)
    return len(by_project), len(entries)


def _lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of each line of the gzip'd pack, bounded in line and total size."""
    total = 0
    try:
        with gzip.open(path, "rb") as f:
            for number, line in enumerate(iter(lambda: f.readline(MAX_LINE + 1), b""), 1):
                total += len(line)
                if len(line) > MAX_LINE or total > MAX_PACK:
                    raise PackFormatError(f"{path}: line {number} is past the size a pack may have "
                                          f"({MAX_LINE >> 20} MiB a line, {MAX_PACK >> 20} MiB in all)")
                try:
                    yield number, from_json(line)
                except ValueError as e:
                    raise PackFormatError(f"{path}: line {number} is not JSON ({e})") from None
    except (gzip.BadGzipFile, EOFError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise InputNotFound(f"--from {path} does not exist") from None
        raise PackFormatError(f"{path} is not a gzip-compressed pack ({e}); make one with `shipyard pack`") from None


def _field(raw: Any, key: str, kind: type, where: str) -> Any:
    if not isinstance(raw, dict) or not isinstance(raw.get(key), kind):
        raise PackFormatError(f"{where}: field '{key}' is missing or not a {kind.__name__}")
    return raw[key]


def read_pack(path: Path) -> list[PackedProject]:
    """The pack at `path`, every task checked against the task and differential schemas; PackFormatError naming
    the line otherwise."""
    path = Path(path)
    lines = _lines(path)
    first = next(lines, None)
    if first is None or not isinstance(first[1], dict) or first[1].get("format") != FORMAT:
        raise PackFormatError(f"{path} is not a shipyard task pack (its first line does not say format {FORMAT!r})")
    if first[1].get("version") != PACK_VERSION:
        raise PackFormatError(f"{path} is pack version {str(first[1].get('version'))[:20]}; this shipyard reads "
                              f"{PACK_VERSION}: pack the task set again with this shipyard")
    projects: list[PackedProject] = []
    seen: set[str] = set()
    for number, raw in lines:
        where = f"{path}: line {number}"
        if isinstance(raw, dict) and "project" in raw:
            p = _field(raw, "project", dict, where)
            project = Project(str(p.get("name")), str(p.get("version")))
            if project.problem() or project.name in {q.project.name for q in projects}:
                raise PackFormatError(f"{where}: project {project} is {project.problem() or 'listed twice'}")
            projects.append(PackedProject(project, _field(raw, "spec", str, where), _field(raw, "commit", str, where),
                                          _field(raw, "synth", dict, where), []))
            continue
        if not projects:
            raise PackFormatError(f"{where}: a task before any project line")
        try:
            # Strict schemas read dataclasses from JSON objects only (JSON mode), so each part is read as JSON.
            task = TASK.validate_json(json.dumps(_field(raw, "task", dict, where)))
            diff = raw.get("differential")
            diff = None if diff is None else differential.DIFFERENTIAL.validate_json(json.dumps(diff))
        except ValidationError as e:
            raise PackFormatError(f"{where}: not a valid task: {schema_problem(e)}") from None
        owner = projects[-1]
        try:
            check_name(task.id, "task id")
        except ValueError as e:
            raise PackFormatError(f"{where}: {e}") from None
        if task.project != owner.project or task.id in seen:
            raise PackFormatError(f"{where}: task {task.id} is {'listed twice' if task.id in seen else 'not of '}"
                                  f"{'' if task.id in seen else str(owner.project)}")
        if task.source.get("commit") != owner.commit:
            raise PackFormatError(f"{where}: task {task.id} was made from another source than its project's line")
        seen.add(task.id)
        owner.tasks.append(PackedTask(task, _field(raw, "gold", str, where), diff))
    expected = first[1].get("tasks")
    if expected != len(seen):
        raise PackFormatError(f"{path} holds {len(seen)} tasks, its header says {str(expected)[:20]}: the file is cut "
                              "short or edited; pack the task set again")
    return projects


def pack_size(path: Path) -> int:
    """How many tasks the pack at `path` says it holds (its header), for a progress bar; 0 when unreadable."""
    try:
        with gzip.open(path, "rb") as f:
            header = from_json(f.readline(1 << 16))
        return int(header["tasks"]) if isinstance(header, dict) and isinstance(header.get("tasks"), int) else 0
    except (OSError, EOFError, ValueError):
        return 0


def gold_problem(gold: str, test_files: list[str]) -> str | None:
    """Why the gold patch may not be applied in reverse on the host: it must edit only Python source files of the
    project (paths checked by `taskset.path_problem`), never a test file, the venv or a mode."""
    changes = parse_patch(gold)
    if not changes:
        return "it changes no file"
    tests = set(test_files)
    for change in changes:
        if change.problem:
            return f"git would refuse it ({change.problem})"
        for rel in change.paths:
            problem = path_problem(rel)
            if problem or not rel.endswith(".py") or rel in tests or is_test_config(rel) \
                    or rel.split("/", 1)[0] in (VENV, ".git") or change.mode not in (None, "100644") or change.binary:
                return f"it edits {rel!r}, which a deletion never does ({problem or 'not a project source file'})"
    return None


def unapply(tree: Path, gold: str) -> str | None:
    """`gold` applied in reverse to `tree` with git (no repository above it is consulted); git's complaint, or
    None."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull}
    proc = subprocess.run(["git", "apply", "-R", "--whitespace=nowarn"], cwd=tree, input=gold.encode(),
                          capture_output=True, env=env, timeout=120)
    return None if proc.returncode == 0 else (proc.stderr.decode(errors="replace").strip().splitlines() or ["?"])[0]


def _rebuild_task(synth: Synthesizer, packed: PackedTask, check: bool) -> Task:
    """One task of the pack into `synth.out`, as synthesis would have written it (module docstring); Rejected with
    the reason when it cannot be."""
    task = packed.task
    stage = synth.work / task.id
    shutil.rmtree(stage, ignore_errors=True)
    tree = stage / "snapshot"
    copy_task_tree(synth.base, tree)
    problem = gold_problem(packed.gold, synth.test_files)
    if problem:
        raise Rejected("gold_refused", problem)
    problem = unapply(tree, packed.gold)
    if problem:
        raise Rejected("gold_mismatch", f"the gold patch does not apply in reverse: {problem}")
    if tree_diff(tree, synth.base) != packed.gold:
        raise Rejected("gold_mismatch", "the deletion, taken again, is not the pack's gold patch")
    if task.test_files != synth.test_files:
        raise Rejected("tests_differ", "the project's test files are not those the task restores")
    synth.write_tests(stage)
    scrub(tree)
    fresh_commit(tree)
    (stage / "gold.patch").write_text(packed.gold)
    if packed.differential is not None:
        differential.save(stage, packed.differential)

    def step(name: str, ok: bool, t0: float, reason: str, detail: str = "", **info) -> None:
        if not ok:
            raise Rejected(reason, detail)

    if check:
        with snapshot_of(tree, host()) as snap:
            check_empty(task, stage, snap, synth.config, step)
            t0 = time.monotonic()
            v = grade(task, stage, packed.gold, synth.config.timeout, snap)
            step("oracle", v.reward == 1.0, t0, "oracle_fails", f"{v.status} {v.failed[:5]} {v.detail[-300:]}")
    try:
        task.save(stage)
    except TaskFormatError as e:
        raise Rejected("invalid_task", str(e)) from None
    dest = synth.out / task.id
    if os.path.lexists(dest):  # not in the index (`claim` checked): what an interrupted run left
        shutil.rmtree(dest) if dest.is_dir() and not dest.is_symlink() else dest.unlink()
    stage.replace(dest)
    return task


def rebuild_project(source: Source, packed: PackedProject, out: Path, config: SynthConfig, check: bool = True,
                    log: Log = print, progress: Callable[[int, int], None] | None = None) -> SynthReport:
    """The tasks of one packed project into the task set `out`; the report lists them and the ones left out."""
    start, (cpu0, unmeasured0) = time.monotonic(), cpu_used()
    synth = Synthesizer(source.path, out, config, log=log, project=packed.project)
    synth.prepare_base()
    if synth.commit != packed.commit:
        raise SourceError(f"{source.spec}: its files are not those the pack's tasks were made from (source "
                          f"{synth.commit}, the pack's {packed.commit}); give --repo the release the pack names, "
                          f"{packed.spec}")
    index: list[IndexEntry] = []
    for packed_task in packed.tasks:
        synth.report.tried += 1
        try:
            task = _rebuild_task(synth, packed_task, check)
        except Rejected as r:
            synth.report.rejections[r.reason] += 1
            synth.report.rejected.append({"task": packed_task.task.id, "reason": r.reason, "detail": r.detail[:500]})
            log(f"  left out {packed_task.task.id}: {r.reason} ({r.detail[:200]})")
            shutil.rmtree(synth.work / packed_task.task.id, ignore_errors=True)
        else:
            synth.report.accepted.append(task.id)
            synth.report.cover(task)
            index.append(IndexEntry.of(task))
            log(f"  rebuilt {task.id}")
        if progress is not None:
            progress(len(synth.report.accepted), synth.report.tried)
    synth.report.rebuilt = {"synth": packed.synth, "checked": check}
    synth.finish(index, start, cpu0, unmeasured0)
    return synth.report


def rebuild(pack: Path, out: Path, config: SynthConfig, repos: Sequence[str] = (), check: bool = True,
            log: Log = print, progress: Callable[[int, int], None] | None = None, skip_done: bool = False) \
        -> list[SynthReport]:
    """Every project of the pack into the task set `out` (module docstring). A `repos` spec (a directory or
    name==version) replaces the pack's spec of the same project; every source is resolved, and every project checked
    against the set, before the first is rebuilt. The reports, in order."""
    projects = read_pack(pack)
    todo = [projects[i] for i in unclaimed([p.project for p in projects], out, skip_done, log)]
    with tempfile.TemporaryDirectory(prefix="shipyard-sources-") as tmp:
        given = {s.project.name: s for s in resolve(repos, Path(tmp), config.index_url, config.cache)} if repos else {}
        unknown = sorted(set(given) - {p.project.name for p in projects})
        if unknown:
            raise UsageError(f"--repo {', '.join(given[n].spec for n in unknown)}: the pack has no tasks of "
                             f"{', '.join(unknown)}; its projects: {', '.join(str(p.project) for p in projects)}")
        sources = [given.get(p.project.name) or resolve([p.spec], Path(tmp), config.index_url, config.cache)[0]
                   for p in todo]
        reports: list[SynthReport] = []
        for source, packed in zip(sources, todo, strict=True):
            log(f"{packed.project}: {len(packed.tasks)} tasks from {source.path}")
            try:
                report = rebuild_project(source, packed, out, config, check, log,
                                         None if progress is None else offset_progress(progress, reports))
            except EnvSetupError as e:
                raise SourceError(f"{packed.project}: {e}") from None
            reports.append(report)
    return reports
