"""`shipyard synth`: feature-deletion tasks from a Python repository with a pytest suite.

Pipeline (Composer 2.5's synthetic tasks: delete a testable feature so the codebase still works, ask for it back):

1. Prepare the environment once (`environment.prepare`: the repo copied without following a link out of it,
   `.venv` with the dependencies, the project editable; see that module for what it refuses and drops). The repo
   is read only there: everything after works on the copy, which holds no link outside its venv.
2. Run the suite 3× in sandboxes (the first with per-test coverage); tests that do not pass all 3 times (flaky
   or broken) are excluded from every task, and so are tests outside the test files (doctests in source modules):
   the grader restores only test files, so a patch could edit those.
3. Choose features per tier from coverage (`features`), interleaving tiers so every tier is represented.
4. For each candidate, build the task and validate it — every step required, every rejection counted by reason:
   the deletion parses; scrubbed snapshot with one fresh commit; leak scan with 0 hits; with an empty patch the
   suite collects cleanly, ≥ 1 FAIL_TO_PASS test exists and at most 30 % of them pass, all PASS_TO_PASS pass;
   the gold patch restores a full pass 3 times out of 3 (the oracle); a `return None` stub patch fails.
5. Write accepted tasks (`taskset` format), appended to the set: their lines to `tasks.jsonl`, the project's report
   (yield, rejections, tasks/CPU-hour) to `synth.json` (`taskset.append_project`).

**Several projects, one set.** A task set may hold tasks of several projects (`shipyard.tasks.pool`), one synthesis
each: a project the set already holds tasks of is refused before any work (`taskset.claim`). Task ids name their
project: `t{tier}-{project}.{module}-{symbols}` (`task_id`). Project names are canonical and hold no `.`, so the text
between the tier and the first `.` is the project, and two projects' ids can never be equal; an id the set already
lists is an error all the same (`TaskSetConflict`), never an overwrite.

The run's record, and how its CPU time is counted, are in `shipyard.tasks.report`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from shipyard.errors import UsageError
from shipyard.harness.confined import PathError, Tree
from shipyard.harness.workspace import tree_diff
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import snapshot_of
from shipyard.tasks import differential
from shipyard.tasks.deletion import Deletion, DeletionError, delete_feature
from shipyard.tasks.environment import VENV, prepare, project_requirements, regular_files
from shipyard.tasks.features import Feature, Symbol, candidates, reach, source_files, symbols_of
from shipyard.tasks.grade import Refused, apply_patch, grade
from shipyard.tasks.patchparse import parse_patch
from shipyard.tasks.patchscan import is_test_config
from shipyard.tasks.report import Rejected, SynthReport, cpu_used
from shipyard.tasks.scrub import fingerprints, fresh_commit, scan, scrub, third_party_files
from shipyard.tasks.sources import directory_project
from shipyard.tasks.statement import statement, stub_source
from shipyard.tasks.suite import run_suite
from shipyard.tasks.taskset import (
    MAX_TEST_FILE,
    DeletedSymbol,
    IndexEntry,
    Project,
    Task,
    TaskFormatError,
    TaskSetConflict,
    append_project,
    claim,
    load_task,
    project_name,
)


@dataclass
class SynthConfig:
    max_tasks: int = 20
    tiers: tuple[int, ...] = (1, 2, 3)
    suite_runs: int = 3
    oracle_runs: int = 3
    max_f2p_pass_rate: float = 0.3
    min_lines: int = 3
    timeout: float = 900.0
    requirements: tuple[str, ...] = ()  # more packages the tests need (`--with`), beyond what the repo declares
    wheel_cache: Path | None = None  # where downloaded wheels are kept (default ~/.cache/shipyard/wheels)
    index_url: str | None = None  # the package index for downloads (default: pip's configured one, else PyPI)
    search_index: bool = True  # give each task its codebase_search index (shipyard.search.service.index_tasks)
    embedder: str = "minilm"  # the index's embedding model

    @property
    def cache(self) -> Path:
        """Where downloads are kept between runs: wheels, and sdists (`wheel_cache`, default
        ~/.cache/shipyard/wheels)."""
        return self.wheel_cache or Path.home() / ".cache" / "shipyard" / "wheels"

    def __post_init__(self) -> None:
        from packaging.requirements import InvalidRequirement, Requirement

        for req in self.requirements:
            try:
                Requirement(req)
            except InvalidRequirement as e:
                why = str(e).splitlines()[0]
                raise UsageError(f"--with / requirements: {req!r} is not a requirement ({why}); write it as pip does: "
                                 f"'hypothesis>=6'") from None


def source_commit(repo: Path, copy: Path, files: list[str]) -> str:
    """The repo's git commit (+dirty), or a hash of its `files` as copied to `copy`. git runs with the repo's
    file-system monitor hook off: `git status` would otherwise run a command the repo's config names."""
    git = ["git", "-c", "core.fsmonitor=false"]
    proc = subprocess.run([*git, "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    if proc.returncode == 0:
        dirty = subprocess.run([*git, "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
        return proc.stdout.strip() + ("+dirty" if dirty.strip() else "")
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.encode() + (copy / f).read_bytes())
    return "sha256:" + digest.hexdigest()[:16]


def task_id(feature: Feature, project: str) -> str:
    """A feature's task id, `t{tier}-{project}.{module}-{symbols}`, a valid name (`check_name`: it is a directory
    name in the task set, checked on load). The module is the first symbol's file as a dotted path, without a leading
    `src` and a leading package named like the project (`pocketlib/stats.py` of pocketlib: `stats`); the symbols are
    joined by `-`; any character a name cannot hold becomes `_`; past 64 characters the end is replaced by a hash of
    the whole id (the `t{tier}-{project}.` prefix is kept: project names are at most 40 characters)."""
    parts = list(PurePosixPath(feature.symbols[0].file).with_suffix("").parts)
    if len(parts) > 1 and parts[0] == "src":
        parts = parts[1:]
    if len(parts) > 1 and project_name(parts[0]) == project:
        parts = parts[1:]
    rest = ".".join(parts) + "-" + "-".join(s.qualname for s in feature.symbols)
    whole = f"t{feature.tier}-{project}.{rest}"
    name = f"t{feature.tier}-{project}." + re.sub(r"[^A-Za-z0-9._-]", "_", rest).replace("..", "._")
    if len(name) > 64:
        name = name[:55] + "-" + hashlib.sha256(whole.encode()).hexdigest()[:8]
    return name


def empty_patch_reason(status: str) -> str:
    """The rejection reason when the empty patch is not graded: an infra status as it is, anything else named as
    the empty patch's outcome."""
    return status if status.startswith("infra") else f"empty_patch_{status}"


def _venv_bytes(venv: Path, files: list[Path]) -> bytes:
    """The contents of `files` (paths under `venv`), each read without following a link; what cannot be is left
    out (the venv was written inside a sandbox)."""
    tree, out = Tree(venv), []
    for path in files:
        rel = os.path.normpath(os.path.relpath(path, venv))
        if rel.startswith(".."):
            continue
        try:
            out.append(tree.read(rel, 1 << 30))
        except (PathError, OSError):
            continue
    return b"\n".join(out)


def copy_task_tree(base: Path, dest: Path) -> None:
    """The repository copied, its (never edited) venv hard-linked: tasks share the venv's disk space."""
    shutil.copytree(base, dest, symlinks=True, ignore=shutil.ignore_patterns(VENV))
    if (base / VENV).exists():
        subprocess.run(["cp", "-al", str(base / VENV), str(dest / VENV)], check=True)


def baseline(base: Path, runs: int, timeout: float) -> tuple[set[str], dict[str, str], dict, list[str]]:
    """Stable tests (passed every run), excluded ones with why, the first run's per-test coverage, and pytest's
    summary lines of test modules that failed to import."""
    results = []
    with snapshot_of(base, host()) as snap:
        for i in range(runs):
            with Sandbox(snap) as sb:
                results.append(run_suite(sb, coverage=i == 0, timeout=timeout))
    if not results[0].outcomes:
        raise RuntimeError(f"the suite reported no tests:\n{results[0].output[-2000:]}")
    stable = set.intersection(*(r.passed for r in results))
    excluded = {}
    for t in set().union(*(r.outcomes for r in results)) - stable:
        excluded[t] = "flaky" if any(t in r.passed for r in results) else "failing"
    errors = [line for line in results[0].output.splitlines() if line.startswith("ERROR ")]
    return stable, excluded, results[0].coverage, errors


def check_empty(task: Task, stage: Path, snap: Path, config: SynthConfig, step: Callable[..., None]) -> None:
    """The empty patch's grade, as a task must have it: graded, the suite collected, every test reported, at most
    `max_f2p_pass_rate` of FAIL_TO_PASS passing and every PASS_TO_PASS test passing (each a `step`)."""
    t0 = time.monotonic()
    empty = grade(task, stage, "", config.timeout, snap)
    if empty.status != "graded":
        step("empty_patch", False, t0, empty_patch_reason(empty.status), empty.detail)
    step("collects", not empty.collection_errors, t0, "collection_error", ", ".join(empty.collection_errors))
    step("tests_present", not empty.missing, t0, "tests_missing", ", ".join(empty.missing[:5]))
    rate = empty.fail_to_pass["passed"] / max(1, empty.fail_to_pass["total"])
    step("f2p_fail", rate <= config.max_f2p_pass_rate, t0, "f2p_pass_rate", f"{rate:.2f}", pass_rate=rate)
    step("p2p_pass", empty.pass_to_pass["passed"] == empty.pass_to_pass["total"], t0, "p2p_broken",
         ", ".join(t for t in empty.failed if t in set(task.pass_to_pass))[:500])


def leaks(tree: Path, snippets: list[str], third_party: bytes) -> tuple[list[str], int]:
    """Where the deleted `snippets` can be found in the scrubbed `tree` (the leak scan), and how many fingerprints
    were searched for."""
    visible = b"\n".join((tree / f).read_bytes() for f in regular_files(tree))
    fps = fingerprints(snippets, visible + b"\n" + third_party)
    return scan(tree, fps), len(fps.all())


class Synthesizer:
    def __init__(self, repo: Path, out: Path, config: SynthConfig, log: Callable[[str], None] = print,
                 progress: Callable[[int, int], None] | None = None, project: Project | None = None):
        """`project`: the project `repo` is a release of (default: what its metadata says, `directory_project`)."""
        self.repo, self.out, self.config, self.log = Path(repo).resolve(), Path(out), config, log
        self.progress = progress or (lambda accepted, tried: None)  # called after every candidate
        self.project = project or directory_project(self.repo)
        self.work = self.out / ".work"
        self.base = self.work / "base"
        self.report = SynthReport(str(self.repo), self.project)

    def task_id(self, feature: Feature) -> str:
        return task_id(feature, self.project.name)

    def prepare_base(self) -> None:
        """The project's environment, prepared once into `self.base` (scrubbed), its source `commit` and
        `test_files`; the ids the set already lists in `listed` (TaskSetConflict when it holds this project)."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.listed = claim(self.out, self.project)  # the ids the set already holds: never overwritten
        self.log("preparing the environment (.venv, dependencies, editable install)")
        prepared = prepare(self.repo, self.base, self.config.cache, timeout=self.config.timeout,
                           extra=self.config.requirements, index_url=self.config.index_url)
        self.report.skipped, self.report.generated = prepared.skipped, prepared.generated
        self.report.sdists, self.report.requirements = prepared.sdists, list(self.config.requirements)
        self.commit = source_commit(self.repo, self.base, prepared.files)
        scrub(self.base)
        self.test_files = self._test_files()
        if self.report.skipped:
            self.log(f"left out {len(self.report.skipped)} entries of the repository (links out of it, dangling or to "
                     "directories, special files): " + "; ".join(f"{p} {why}" for p, why in
                                                               list(self.report.skipped.items())[:10])
                     + (" …" if len(self.report.skipped) > 10 else ""))
        if prepared.generated:
            self.log(f"kept {len(prepared.generated)} files the editable build generated: "
                     + ", ".join(prepared.generated[:10]))

    def run(self) -> SynthReport:
        start, (cpu0, unmeasured0) = time.monotonic(), cpu_used()
        self.prepare_base()
        self.log(f"running the suite {self.config.suite_runs}× (the first with per-test coverage)")
        stable, excluded, coverage, errors = baseline(self.base, self.config.suite_runs, self.config.timeout)
        outside = {t for t in stable if t.split("::", 1)[0] not in set(self.test_files)}
        if outside:
            stable -= outside
            excluded |= dict.fromkeys(outside, "outside_test_files")
            self.log(f"{len(outside)} passing tests are not in test files (doctests in source modules?) and are in "
                     "no task: a patch could edit them")
        self.report.stable_tests, self.report.excluded_tests = len(stable), excluded
        self.report.baseline_errors = errors
        if errors:
            self.log(f"warning: {len(errors)} test modules fail before any deletion, their tests are left out "
                     "(a missing test dependency? name it with --with):\n    " + "\n    ".join(errors[:10]))
        symbols = self.symbols()
        reached = reach(symbols, coverage, stable)
        pools = {t: candidates(symbols, reached, stable, t, self.config.min_lines) for t in self.config.tiers}
        self.log(f"{len(stable)} stable tests, {len(excluded)} excluded; candidates per tier: "
                 + ", ".join(f"T{t} {len(p)}" for t, p in pools.items()))
        third_party = self.third_party()
        used: dict[int, set] = {t: set() for t in pools}
        per_tier: Counter = Counter()
        index: list[IndexEntry] = []
        while len(self.report.accepted) < self.config.max_tasks and any(pools.values()):
            # Balanced tiers: the tier with the fewest accepted tasks (that still has candidates) goes next.
            tier = min((t for t in pools if pools[t]), key=lambda t: (per_tier[t], t))
            feature = pools[tier].pop(0)
            tid = self.task_id(feature)
            if used[tier] & set(feature.symbols) or tid in self.report.accepted:
                continue  # one task per symbol and tier
            if tid in self.listed:
                raise TaskSetConflict(f"task {tid} of {self.project.name} is already in the task set {self.out}; a "
                                      "task set is appended to, never overwritten")
            self.report.tried += 1
            try:
                task = self.validate(feature, third_party)
            except Rejected as r:
                self.report.rejections[r.reason] += 1
                self.report.rejected.append({"feature": feature.id, "reason": r.reason, "detail": r.detail[:500]})
                self.log(f"  rejected {feature.id}: {r.reason}")
                shutil.rmtree(self.work / tid, ignore_errors=True)
                self.progress(len(self.report.accepted), self.report.tried)
                continue
            used[tier] |= set(feature.symbols)
            per_tier[tier] += 1
            self.report.accepted.append(task.id)
            self.report.cover(task)
            index.append(IndexEntry.of(task))
            self.log(f"  accepted {task.id} ({len(task.fail_to_pass)} FAIL_TO_PASS)")
            self.progress(len(self.report.accepted), self.report.tried)
        self.finish(index, start, cpu0, unmeasured0)
        return self.report

    def finish(self, index: list[IndexEntry], start: float, cpu0: float, unmeasured0: int) -> None:
        """The accepted tasks' search indexes, the work directory removed, the report's timings, and the project's
        tasks and report appended to the set."""
        if self.config.search_index and self.report.accepted:
            from shipyard.search.service import index_tasks, shared_embedder

            self.log("building the tasks' codebase_search indexes")
            index_tasks(self.base, [self.out / t for t in self.report.accepted], shared_embedder(self.config.embedder),
                        self.work, self.log)
        shutil.rmtree(self.work, ignore_errors=True)
        self.report.seconds = round(time.monotonic() - start, 1)
        cpu1, unmeasured1 = cpu_used()
        self.report.cpu_seconds, self.report.unmeasured_sandboxes = round(cpu1 - cpu0, 1), unmeasured1 - unmeasured0
        append_project(self.out, index, self.project, self.report.to_json())

    def validate(self, feature: Feature, third_party: bytes) -> Task:
        steps: list[dict] = []

        def step(name: str, ok: bool, t0: float, reason: str, detail: str = "", **info) -> None:
            steps.append({"name": name, "ok": ok, "seconds": round(time.monotonic() - t0, 2), **info})
            if not ok:
                raise Rejected(reason, detail)

        stage = self.fresh_stage(self.task_id(feature))
        tree = stage / "snapshot"
        t0 = time.monotonic()
        deletion = self.delete(tree, feature)
        step("delete", True, t0, "", files=deletion.changed)
        self.write_tests(stage)
        gold = tree_diff(tree, self.base)
        stub = self._stub_patch(tree, feature, stage)
        t0 = time.monotonic()
        step("scrub", True, t0, "", removed=self.scrub_tree(tree))
        t0 = time.monotonic()
        hits, searched = leaks(tree, deletion.snippets, third_party)
        step("leak_scan", not hits, t0, "leak", f"deleted code found in {hits[:5]}", fingerprints=searched)
        lines = sum(s.end - (s.body_start if feature.tier < 3 else s.start) + 1 for s in feature.symbols)
        task = Task(stage.name, feature.tier, statement(feature, tree), feature.fail_to_pass, feature.pass_to_pass,
                    [DeletedSymbol(s.file, s.qualname, s.start, s.end) for s in feature.symbols], lines,
                    {"repo": str(self.repo), "commit": self.commit}, test_files=self.test_files,
                    fingerprints=searched, project=self.project)
        with snapshot_of(tree, host()) as snap:  # one sandbox snapshot for every grading run of this task
            try:
                self._grade_steps(task, stage, gold, stub, snap, step)
            except TaskFormatError as e:  # e.g. differential cases the repository's code made unreadable
                raise Rejected("invalid_task", str(e)) from None
        task.validation = steps
        self.place(task, stage)
        return task

    def fresh_stage(self, task_id: str) -> Path:
        """A new stage for `task_id` (work/ID), its snapshot a copy of the prepared base."""
        stage = self.work / task_id
        shutil.rmtree(stage, ignore_errors=True)
        copy_task_tree(self.base, stage / "snapshot")
        return stage

    @staticmethod
    def delete(tree: Path, feature: Feature) -> Deletion:
        """`feature` deleted from `tree`; Rejected when its source cannot be parsed and edited."""
        try:
            return delete_feature(tree, feature)
        except DeletionError as e:
            raise Rejected("deletion_unparsable", str(e)) from None

    @staticmethod
    def scrub_tree(tree: Path) -> list[str]:
        """The task's tree without the project's history and caches, as one fresh commit; what was removed."""
        removed = scrub(tree)
        fresh_commit(tree)
        return removed

    def place(self, task: Task, stage: Path) -> None:
        """Save `task` in its stage, read it back as every later reader will, and move the stage into the task set
        (its id not listed there: the caller checked)."""
        try:
            task.save(stage)
            load_task(self.work, task.id)
            differential.load(stage)
        except TaskFormatError as e:
            raise Rejected("invalid_task", str(e)) from None
        dest = self.out / task.id
        if os.path.lexists(dest):  # what an interrupted run left
            self.log(f"  replacing {dest}, which the task set's index does not list (left by an interrupted run?)")
            shutil.rmtree(dest) if dest.is_dir() and not dest.is_symlink() else dest.unlink()
        stage.replace(dest)

    def symbols(self) -> list[Symbol]:
        """Every definition of the base's non-test code (`features.symbols_of`)."""
        return [s for f in source_files(self.base) for s in symbols_of(f, (self.base / f).read_text())]

    def third_party(self) -> bytes:
        """The bytes of the venv's distributions other than the project: the leak scan's fingerprints must be rare
        there too (code also found in a dependency is no leak of the answer)."""
        name = project_requirements(self.base)[0]
        return _venv_bytes(self.base / VENV, third_party_files(self.base / VENV, name and name.lower()))

    def write_tests(self, stage: Path) -> None:
        """The canonical copies of the test files, from the base, into the task's `tests/`."""
        base = Tree(self.base)
        for rel in self.test_files:
            (stage / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
            (stage / "tests" / rel).write_bytes(base.read(rel, MAX_TEST_FILE))

    def _test_files(self) -> list[str]:
        """The base's test files and test configuration (what tasks restore before grading), each a regular file
        of at most MAX_TEST_FILE bytes; larger ones are reported as skipped."""
        out = []
        for rel in regular_files(self.base):
            if is_test_config(rel):
                if (self.base / rel).stat().st_size <= MAX_TEST_FILE:
                    out.append(rel)
                else:
                    self.report.skipped[rel] = f"is a test file larger than {MAX_TEST_FILE} bytes"
        return out

    def _grade_steps(self, task: Task, stage: Path, gold: str, stub: str, snap: Path, step) -> None:
        check_empty(task, stage, snap, self.config, step)
        (stage / "gold.patch").write_text(gold)
        t0 = time.monotonic()  # the differential cases, before the oracle runs: gold must pass its own cases too
        diff = self._record(task, stage, gold, snap)
        differential.save(stage, diff)
        task.differential = {**diff.summary(), "why_none": diff.why_none()}
        step("differential", True, t0, "", cases=len(diff.cases), why_none=diff.why_none())
        for i in range(self.config.oracle_runs):
            t0 = time.monotonic()
            v = grade(task, stage, gold, self.config.timeout, snap)
            step(f"oracle_{i + 1}", v.reward == 1.0, t0, "oracle_fails" if i == 0 else "oracle_flaky",
                 f"{v.status} {v.failed[:5]} {v.missing[:5]} {v.detail[-300:]}")
        t0 = time.monotonic()
        v = grade(task, stage, stub, self.config.timeout, snap)
        step("stub_fails", v.reward == 0.0, t0, "stub_passes", v.status)

    def _record(self, task: Task, stage: Path, gold: str, snap: Path) -> differential.Differential:
        """The task's differential cases, recorded from the original code: a sandbox over the task's snapshot with
        the gold patch applied and the canonical tests in place."""
        try:
            with Sandbox(snap) as sb:
                apply_patch(sb, gold, parse_patch(gold))
                for rel in task.test_files:
                    sb.write_bytes(rel, (stage / "tests" / rel).read_bytes())
                seed = int.from_bytes(hashlib.sha256(task.id.encode()).digest()[:4], "big")
                return differential.record(sb, task, self.config.timeout, seed)
        except (OSError, RuntimeError, ValueError, Refused) as e:  # the task stays valid, without cases
            return differential.Differential(reasons={f"the recording sandbox failed ({type(e).__name__})": 1})

    def _stub_patch(self, tree: Path, feature: Feature, stage: Path) -> str:
        """The deleted functions implemented as `return None` (T3: stub definitions appended to the module)."""
        stub = stage / "stub"
        shutil.copytree(tree, stub, symlinks=True, ignore=shutil.ignore_patterns(VENV))
        for file in {s.file for s in feature.symbols}:
            path = stub / file
            path.write_text(stub_source(path.read_text(), [s for s in feature.symbols if s.file == file],
                                        feature.tier))
        try:
            return tree_diff(tree, stub)
        finally:
            shutil.rmtree(stub)

