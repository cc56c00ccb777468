"""Task packs: a task set as one small file, rebuilt on another machine in minutes instead of CPU hours.

A task set is large (each task's `snapshot/` holds the project and its `.venv`: gigabytes for a pool) and costly to
make (synthesis grades every candidate about eleven times). What defines a task is small: the project's release,
which definitions were deleted, the tests that decide it, its statement and differential cases. A pack holds exactly
that, so a pool can be committed, shared or moved, and rebuilt wherever `shipyard synth` runs (`shipyard pack`,
`shipyard synth --from`), the way SWE-bench ships task instances rather than images.

**Format** (gzip-compressed JSON lines; `PACK_VERSION`):

    {"format": "shipyard-task-pack", "version": 1, "projects": P, "tasks": T}
    {"project": {"name", "version"}, "commit": C, "requirements": [...], "synth": SUMMARY}   one per project,
    {"task": TASK_JSON, "gold": GOLD_PATCH, "differential": CASES or null}                   then its tasks

`commit` is the project's source commit as synthesis recorded it (`synth.source_commit`: for an sdist, a hash of
its files as copied); `requirements` what `--with` added; `synth` a summary of its synthesis (`SUMMARY_KEYS`).

**Rebuilding** (`rebuild`) runs synthesis's own steps, except the search for candidates and most of their grading:
the release `name==version` is fetched (sha256-checked against the index), or taken from a `--repo` directory of
the same project; its environment is prepared (`Synthesizer.prepare_base`) and its source commit must equal the
pack's, so the code is the one the tasks were made from. Each task's deletion is made again by this shipyard
(`deletion.delete_feature` on the symbols the task names), and the diff back to the original must equal the pack's
gold patch byte for byte: the snapshot is then exactly a deletion of the release's own code, never something a pack
wrote. The leak scan runs again; tests, scrub, fresh commit and search index are made as synthesis makes them.

**Trust.** A pack is input like a task directory (`taskset`): possibly edited or planted. No patch of the pack is
ever applied (the tree is made by the deletion code), so a pack cannot write files, links or modes; ids must be of
their project and tier and new to the set; every task goes through the task and differential schemas and is read
back from disk before it joins the set. The test lists and statement are the pack's, so by default each task is
graded again (`check`): the empty patch must fail as synthesis requires (`synth.check_empty`) and the gold patch
must pass. `check=False` trusts the pack's test lists (for a pack one made oneself). A task that fails is left out
and named, counted by reason; a project whose release differs is left out whole; the rest is kept, and the caller
reports failure.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import from_json

from shipyard.errors import FileFormatError, InputNotFound, UsageError
from shipyard.harness.diff import tree_diff
from shipyard.sandbox.host import host
from shipyard.sandbox.snapshot import snapshot_of
from shipyard.tasks import differential
from shipyard.tasks.environment import EnvSetupError
from shipyard.tasks.features import Feature, Symbol
from shipyard.tasks.grade import MAX_GOLD, grade, read_gold
from shipyard.tasks.pool import offset_progress, unclaimed
from shipyard.tasks.report import Rejected, SynthReport, cpu_used
from shipyard.tasks.sources import Source, SourceError, resolve
from shipyard.tasks.synth import SynthConfig, Synthesizer, check_empty, leaks
from shipyard.tasks.taskset import (
    MAX_TASK_JSON,
    TASK,
    TASK_VERSION,
    IndexEntry,
    Project,
    Task,
    TaskFormatError,
    index_entries,
    load_task,
    schema_problem,
    synth_reports,
)

FORMAT = "shipyard-task-pack"
PACK_VERSION = 1
MAX_PACK = 1 << 30  # bytes of a pack, decompressed (a 160-task pool is a few MiB)
MAX_LINE = 2 * (MAX_TASK_JSON + differential.MAX_DIFF_FILE + MAX_GOLD)  # one task line, JSON escaping included
MAX_SUMMARY = 1 << 20  # bytes of a project's synthesis summary
SUMMARY_KEYS = ("accepted", "tried", "rejections", "stable_tests", "seconds", "cpu_seconds", "yield",
                "tasks_per_cpu_hour")
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
    commit: str
    requirements: list[str]
    synth: dict[str, Any]
    tasks: list[PackedTask]

    @property
    def spec(self) -> str | None:
        """The release to fetch (None for a project without a version: its source must be given)."""
        return None if self.project.version is None else str(self.project)


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """A project's synthesis report cut to `SUMMARY_KEYS` (a rebuilt set's: the summary of the synthesis it was
    rebuilt from, so packs of packs do not nest)."""
    rebuilt = report.get("rebuilt")
    report = rebuilt["synth"] if isinstance(rebuilt, dict) and isinstance(rebuilt.get("synth"), dict) else report
    return {k: report[k] for k in SUMMARY_KEYS if k in report}


def write_pack(tasks_dir: Path, out: Path) -> tuple[int, int]:
    """The task set `tasks_dir` as a pack at `out` (through a temporary file and a rename); (projects, tasks)."""
    tasks_dir, out = Path(tasks_dir), Path(out)
    if out.is_dir() or not out.parent.is_dir():
        raise UsageError(f"--out {out}: give a file name in an existing directory (e.g. pool.pack.gz)")
    entries = index_entries(tasks_dir)
    if not entries:
        raise InputNotFound(f"--tasks {tasks_dir} lists no tasks (no tasks.jsonl, or it is empty): pack a task set "
                            "made by `shipyard synth`")
    reports = synth_reports(tasks_dir)
    by_project: dict[str, list[tuple[Task, Path]]] = {}
    for entry in entries:
        task, task_dir = load_task(tasks_dir, entry.id)
        by_project.setdefault(task.project.name, []).append((task, task_dir))
    lines = [{"format": FORMAT, "version": PACK_VERSION, "projects": len(by_project), "tasks": len(entries)}]
    for name, tasks in by_project.items():
        commits = {t.source.get("commit") for t, _ in tasks}
        if len(commits) != 1:
            raise TaskFormatError(f"the tasks of {name} in {tasks_dir} were made from {len(commits)} different "
                                  "sources; a pack holds one release of each project")
        report = reports.get(name, {})
        lines.append({"project": asdict(tasks[0][0].project), "commit": commits.pop(),
                      "requirements": report.get("requirements", []), "synth": summary(report)})
        for task, task_dir in tasks:
            gold = read_gold(task_dir)
            if not gold:
                raise TaskFormatError(f"{task_dir} has no gold.patch: re-create the task with `shipyard synth`")
            diff = differential.load(task_dir)
            lines.append({"task": asdict(task), "gold": gold, "differential": None if diff is None else asdict(diff)})
    tmp = out.with_name(out.name + ".partial")
    try:
        with gzip.open(tmp, "wt", encoding="utf-8") as f:
            for line in lines:
                text = json.dumps(line) + "\n"
                if len(text.encode()) > MAX_LINE:
                    raise TaskFormatError(f"task {line['task']['id']} is larger than a pack line may be "
                                          f"({MAX_LINE >> 20} MiB)")
                f.write(text)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return len(by_project), len(entries)


def _lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of each line of the gzip'd pack, bounded in line and total size. The whole stream is
    checked first (gzip's CRC is only read at its end): a corrupted pack is named as such, not by the line that the
    corruption happens to garble."""
    total = 0
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
                if total > MAX_PACK + 1:
                    break  # the line loop names it
        total = 0
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
    except FileNotFoundError:
        raise InputNotFound(f"--from {path} does not exist") from None
    except (gzip.BadGzipFile, EOFError, zlib.error, OSError) as e:
        raise PackFormatError(f"{path} is not a gzip-compressed pack ({e}); make one with `shipyard pack`") from None


def _field(raw: Any, key: str, kinds: type | tuple[type, ...], where: str) -> Any:
    value = raw.get(key) if isinstance(raw, dict) else None
    if not isinstance(value, kinds) or isinstance(value, bool):
        raise PackFormatError(f"{where}: field '{key}' is missing or of the wrong type")
    return value


def _project(raw: dict, where: str, known: list[PackedProject]) -> PackedProject:
    p = _field(raw, "project", dict, where)
    project = Project(_field(p, "name", str, where), p.get("version") if p.get("version") is None
                      else _field(p, "version", str, where))
    if project.problem() or project.name in {q.project.name for q in known}:
        raise PackFormatError(f"{where}: project {project} is {project.problem() or 'listed twice'}")
    requirements = _field(raw, "requirements", list, where)
    if not all(isinstance(r, str) and _index_requirement(r) for r in requirements):
        raise PackFormatError(f"{where}: field 'requirements' is not a list of requirements by name (and version): "
                              "a pack's requirements come from the package index, never from a URL or a path")
    synth = _field(raw, "synth", dict, where)
    if len(json.dumps(synth)) > MAX_SUMMARY:
        raise PackFormatError(f"{where}: the synthesis summary is larger than {MAX_SUMMARY >> 20} MiB")
    return PackedProject(project, _field(raw, "commit", str, where), requirements, synth, [])


def _index_requirement(text: str) -> bool:
    """Whether `text` is a requirement pip resolves from the package index (a name, extras, versions, markers)."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        return Requirement(text).url is None and not text.lstrip().startswith("-")
    except InvalidRequirement:
        return False


def _task(raw: dict, where: str, owner: PackedProject) -> PackedTask:
    try:  # strict schemas read dataclasses from JSON objects only (JSON mode), so each part is read as JSON
        task = TASK.validate_json(json.dumps(_field(raw, "task", dict, where)))
        diff = raw.get("differential")
        diff = None if diff is None else differential.DIFFERENTIAL.validate_json(json.dumps(diff))
    except ValidationError as e:
        raise PackFormatError(f"{where}: not a valid task: {schema_problem(e)}") from None
    prefix = f"t{task.tier}-{owner.project.name}."
    problem = (f"is of format version {task.version}, not {TASK_VERSION}" if task.version != TASK_VERSION
               else f"is not of {owner.project}" if task.project != owner.project
               else f"does not start with {prefix} (its tier and project)" if not task.id.startswith(prefix)
               else "was made from another source than its project's line"
               if task.source.get("commit") != owner.commit else None)
    if problem:
        raise PackFormatError(f"{where}: task {task.id[:80]} {problem}")
    return PackedTask(task, _field(raw, "gold", str, where), diff)


def read_pack(path: Path) -> list[PackedProject]:
    """The pack at `path`, every task checked against the task and differential schemas; PackFormatError naming
    the line otherwise."""
    path = Path(path)
    lines = _lines(path)
    first = next(lines, None)
    header = first[1] if first is not None and isinstance(first[1], dict) else {}
    if header.get("format") != FORMAT:
        raise PackFormatError(f"{path} is not a shipyard task pack (its first line does not say format {FORMAT!r})")
    if header.get("version") != PACK_VERSION:
        raise PackFormatError(f"{path} is pack version {str(header.get('version'))[:20]}; this shipyard reads "
                              f"{PACK_VERSION}: pack the task set again with this shipyard")
    projects: list[PackedProject] = []
    seen: set[str] = set()
    for number, raw in lines:
        where = f"{path}: line {number}"
        if isinstance(raw, dict) and "project" in raw:
            projects.append(_project(raw, where, projects))
        elif not projects:
            raise PackFormatError(f"{where}: a task before any project line")
        else:
            packed = _task(raw, where, projects[-1])
            if packed.task.id in seen:
                raise PackFormatError(f"{where}: task {packed.task.id} is listed twice")
            seen.add(packed.task.id)
            projects[-1].tasks.append(packed)
    if header.get("tasks") != len(seen) or isinstance(header.get("tasks"), bool):
        raise PackFormatError(f"{path} holds {len(seen)} tasks, its header says {str(header.get('tasks'))[:20]}: the "
                              "file is cut short or edited; pack the task set again")
    return projects


def pack_size(path: Path) -> int:
    """How many tasks the pack at `path` says it holds (its header), for a progress bar; 0 when unreadable."""
    try:
        with gzip.open(path, "rb") as f:
            header = from_json(f.readline(1 << 16))
        return int(header["tasks"]) if isinstance(header, dict) and isinstance(header.get("tasks"), int) else 0
    except (OSError, EOFError, ValueError, zlib.error):
        return 0


def feature_of(task: Task, symbols: dict[tuple[str, str, int, int], Symbol]) -> Feature:
    """The feature whose deletion made `task`: its symbols found in the base by file, name and lines."""
    found = [symbols.get((d.file, d.qualname, d.start, d.end)) for d in task.deleted]
    missing = [f"{d.file}:{d.qualname}" for d, s in zip(task.deleted, found, strict=True) if s is None]
    if missing or not found:
        raise Rejected("deletion_differs", f"the release has no definition {', '.join(missing[:3])} at the lines "
                                           "the task names")
    return Feature(task.tier, tuple(found), task.fail_to_pass, task.pass_to_pass)


class Rebuild:
    """One packed project's tasks into a task set, through a `Synthesizer` over its source."""

    def __init__(self, synth: Synthesizer, check: bool):
        self.synth, self.check = synth, check
        synth.prepare_base()
        self.symbols = {(s.file, s.qualname, s.start, s.end): s for s in synth.symbols()}
        self.third_party = synth.third_party()

    def task(self, packed: PackedTask) -> Task:
        """One task, as synthesis would have written it (module docstring); Rejected with the reason otherwise."""
        synth, task = self.synth, packed.task
        if task.id in synth.listed:
            raise Rejected("id_taken", f"the task set already lists a task {task.id}")
        if task.test_files != synth.test_files:
            raise Rejected("tests_differ", "the release's test files are not those the task restores")
        stage = synth.fresh_stage(task.id)
        tree = stage / "snapshot"
        deletion = synth.delete(tree, feature_of(task, self.symbols))
        if tree_diff(tree, synth.base) != packed.gold:
            raise Rejected("gold_mismatch", "this shipyard's deletion of the task's definitions is not the pack's gold "
                                            "patch: the pack was edited, or made by another version of synthesis "
                                            "(synthesize the project again)")
        synth.write_tests(stage)
        synth.scrub_tree(tree)
        hits, _ = leaks(tree, deletion.snippets, self.third_party)
        if hits:
            raise Rejected("leak", f"deleted code found in {hits[:5]}")
        (stage / "gold.patch").write_text(packed.gold)
        if packed.differential is not None:
            differential.save(stage, packed.differential)
        if self.check:
            self.regrade(task, stage, packed.gold)
        synth.place(task, stage)  # not listed (checked above), and named for this project, which the set lacks
        return task

    def regrade(self, task: Task, stage: Path, gold: str) -> None:
        def step(name: str, ok: bool, t0: float, reason: str, detail: str = "", **info) -> None:
            if not ok:
                raise Rejected(reason, detail)

        with snapshot_of(stage / "snapshot", host()) as snap:
            check_empty(task, stage, snap, self.synth.config, step)
            v = grade(task, stage, gold, self.synth.config.timeout, snap)
            step("oracle", v.reward == 1.0, 0.0, "oracle_fails", f"{v.status} {v.failed[:5]} {v.detail[-300:]}")


def rebuild_project(source: Source, packed: PackedProject, out: Path, config: SynthConfig, check: bool = True,
                    log: Log = print, progress: Callable[[int, int], None] | None = None) -> SynthReport:
    """The tasks of one packed project into the task set `out`; the report lists them and the ones left out (all of
    them, `source_differs`, when the source is not the release the pack's tasks were made from)."""
    start, (cpu0, unmeasured0) = time.monotonic(), cpu_used()
    synth = Synthesizer(source.path, out, replace(config, requirements=tuple(packed.requirements)), log=log,
                        project=packed.project)
    index: list[IndexEntry] = []
    try:
        rebuild = Rebuild(synth, check)
        if synth.commit != packed.commit:
            raise SourceError(f"{source.spec}: its files are not those the pack's tasks were made from (source "
                              f"{synth.commit}, the pack's {packed.commit})")
    except (SourceError, EnvSetupError) as e:  # this project is left out; the others are still rebuilt
        shutil.rmtree(synth.work, ignore_errors=True)
        reason = "source_differs" if isinstance(e, SourceError) else "environment_failed"
        log(f"  left out all {len(packed.tasks)} tasks of {packed.project}: {e}")
        synth.report.tried = len(packed.tasks)
        synth.report.rejections[reason] = len(packed.tasks)
        synth.report.rejected.append({"project": packed.project.name, "reason": reason, "detail": str(e)[:500]})
        return synth.report
    for packed_task in packed.tasks:
        synth.report.tried += 1
        try:
            task = rebuild.task(packed_task)
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
    name==version) is the source of the pack's project of the same name; the others are fetched as the release the
    pack names. Every source is resolved, and every project checked against the set, before the first is rebuilt.
    The reports, in order."""
    projects = read_pack(pack)
    todo = [projects[i] for i in unclaimed([p.project for p in projects], out, skip_done, log)]
    with tempfile.TemporaryDirectory(prefix="shipyard-sources-") as tmp:
        given = {s.project.name: s for s in resolve(repos, Path(tmp), config.index_url, config.cache)} if repos else {}
        unknown = sorted(set(given) - {p.project.name for p in projects})
        if unknown:
            raise UsageError(f"--repo {', '.join(given[n].spec for n in unknown)}: the pack has no tasks of "
                             f"{', '.join(unknown)}; its projects: {', '.join(str(p.project) for p in projects)}")
        unversioned = [str(p.project) for p in todo if p.spec is None and p.project.name not in given]
        if unversioned:
            raise UsageError(f"the pack's project(s) {', '.join(unversioned)} state no version, so no release can be "
                             "fetched: give each source with --repo DIR")
        sources = [given.get(p.project.name) or resolve([p.spec], Path(tmp), config.index_url, config.cache)[0]
                   for p in todo]
        for source, packed in zip(sources, todo, strict=True):
            if source.project.name != packed.project.name:  # a release whose metadata names another project
                raise SourceError(f"{source.spec} is project {source.project.name}, not {packed.project.name}")
        reports: list[SynthReport] = []
        for source, packed in zip(sources, todo, strict=True):
            log(f"{packed.project}: {len(packed.tasks)} tasks from {source.path}")
            reports.append(rebuild_project(source, packed, out, config, check, log,
                                           None if progress is None else offset_progress(progress, reports)))
    return reports
