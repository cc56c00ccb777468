"""The task-set directory format (documented for users in docs/tasks.md), read through one schema.

    TASKS_DIR/
      tasks.jsonl            one line per task: {"id", "tier", "fail_to_pass", "lines_deleted", "project"} (an index)
      synth.json             {"projects": {name: the synthesis report of that project}}: yield, rejections, timings
      baseline/<model>.json  per-task base pass@k of a model (`shipyard.tasks.baseline`), when recorded
      <task-id>/
        task.json            `Task` below
        snapshot/            the scrubbed, agent-visible repository (one fresh commit, `.venv` prepared)
        gold.patch           restores the deleted code (`git diff`, paths relative to the snapshot root)
        tests/               canonical copies of the test files and test configuration, by their repo path

`gold.patch` and `tests/` are never inside `snapshot/`: nothing an agent can read reveals the answer.

A task directory is input like any other: copied between machines, edited by hand, possibly planted. The grader
trusts what it reads here (which tests decide the reward, which files it restores), so everything is checked on
the way in, and a bad file is one `TaskFormatError` line naming the file and the field, never a traceback:

* `task.json` is read without following a link and capped in size (`MAX_TASK_JSON`), parsed by pydantic's JSON
  parser (bounded nesting: a deeply nested file is an error, not a `RecursionError`) and validated strictly
  against the dataclasses below — missing and unknown fields, wrong types (`"1"` is not a tier).
* Then what types cannot say: the id is the directory's name and a valid name (`check_name`); `fail_to_pass` is
  not empty (an empty list would reward the empty patch); every test id's file is one of `test_files` (the grader
  restores exactly those, so no deciding test lives in a file the patch may edit); `test_files` and deleted files
  are relative POSIX paths inside the repository; every test file exists in the task's own `tests/` as a regular
  file reached through real directories only (`read_canonical`: each component opened with `O_NOFOLLOW`).
* `Task.save` runs the same checks, so synthesis cannot write a task this module would refuse.

**Projects.** A task set may hold tasks of several projects (`shipyard synth` over several repositories), so every
task names its `project` (`Project`: canonical name and version), which a held-out split can go by. Version 3 of the
format added the field; a version-2 task is still read, its project derived from `source["repo"]` (the directory's
name, split as `name-version` where the tail is a version, as an sdist's root directory is named).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config
from pydantic_core import from_json

from shipyard.errors import FileFormatError, UsageError
from shipyard.harness.confined import Tree
from shipyard.sandbox.snapshot import check_name

TASK_VERSION = 3
READ_VERSIONS = (2, 3)  # version 2: no `project` (derived from `source`)
MAX_TASK_JSON = 4 << 20  # bytes of one task.json (a task with thousands of tests is well under 1 MiB)
MAX_INDEX = 64 << 20  # bytes of tasks.jsonl
MAX_TEST_FILE = 16 << 20  # bytes of one canonical test file
RECREATE = "re-create it with `shipyard synth`"
STRICT = ConfigDict(extra="forbid", strict=True)
PROJECT_NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")  # a canonical (PEP 503) name: no `.`, no `_`
MAX_PROJECT_NAME = 40  # task ids begin `t{tier}-{project}.` and hold at most 64 characters
MAX_PROJECT_VERSION = 64


class TaskFormatError(FileFormatError):
    """A task directory or task.json is malformed; the message names the file and the problem."""


class TaskSetConflict(UsageError):
    """Synthesis would overwrite what a task set holds: a project it already has tasks of, or a task id it already
    lists. Task sets are appended to, never silently overwritten."""


@with_config(STRICT)
@dataclass(frozen=True)
class Project:
    """The project a task was made from: its canonical name (PEP 503: lowercase, runs of `-_.` as one `-`) and its
    version (None where the repository does not say)."""

    name: str
    version: str | None = None

    def problem(self) -> str | None:
        """Why this is not a valid project record (None if it is)."""
        if not PROJECT_NAME.fullmatch(self.name) or len(self.name) > MAX_PROJECT_NAME:
            return (f"name {self.name[:80]!r} is not a canonical project name of at most {MAX_PROJECT_NAME} "
                    "characters (lowercase letters, digits, single '-')")
        if self.version is not None and not (0 < len(self.version) <= MAX_PROJECT_VERSION
                                             and self.version.isprintable() and not any(c.isspace()
                                                                                        for c in self.version)):
            return f"version {self.version[:80]!r} is not a version (1-{MAX_PROJECT_VERSION} printable characters)"
        return None

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}=={self.version}"


def project_name(raw: str) -> str:
    """`raw` (a distribution name from metadata, a directory name) as a canonical project name: PEP 503's
    canonical form, anything else a name cannot hold as `-`, cut to MAX_PROJECT_NAME; "project" if nothing is left."""
    name = re.sub(r"[^a-z0-9]+", "-", canonicalize_name(raw)).strip("-")[:MAX_PROJECT_NAME].strip("-")
    return name or "project"


def project_from_source(source: dict[str, str]) -> Project:
    """The project of a version-2 task, from the name of the directory it was synthesized from: `parse-1.22.4` (an
    sdist's root) is parse 1.22.4; any other name is a project of unknown version."""
    base = re.split(r"[/\\]", source.get("repo", "").rstrip("/\\"))[-1]
    head, _, tail = base.rpartition("-")
    if head and tail:
        try:
            Version(tail)
            return Project(project_name(head), tail)
        except InvalidVersion:
            pass
    return Project(project_name(base))


@with_config(STRICT)
@dataclass
class DeletedSymbol:
    file: str
    qualname: str
    start: int
    end: int


@with_config(STRICT)
@dataclass
class Task:
    id: str
    tier: int
    statement: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    deleted: list[DeletedSymbol]
    lines_deleted: int
    source: dict[str, str]  # {"repo": path, "commit": git commit or content hash}
    test_files: list[str] = field(default_factory=list)  # repo paths restored from tests/ before grading
    fingerprints: int = 0  # how many unique fingerprints of the deleted code the leak scan searched for
    validation: list[dict[str, Any]] = field(default_factory=list)  # each step: name, ok, seconds, details
    differential: dict[str, Any] = field(default_factory=dict)  # `differential.Differential.summary()`
    project: Project | None = None  # required from version 3 on; derived from `source` for version 2
    version: int = TASK_VERSION

    @property
    def symbols(self) -> list[str]:
        return [f"{d.file}:{d.qualname}" for d in self.deleted]

    def save(self, task_dir: Path) -> None:
        """Write `task.json` into `task_dir` (whose `tests/` must already hold the test files), checked first."""
        path = Path(task_dir) / "task.json"
        check_task(self, Path(task_dir), str(path))
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


@with_config(STRICT)
@dataclass
class IndexEntry:
    """One line of tasks.jsonl."""

    id: str
    tier: int
    fail_to_pass: int
    lines_deleted: int
    project: Project | None = None  # absent from the lines of version-2 task sets

    @classmethod
    def of(cls, task: Task) -> IndexEntry:
        return cls(task.id, task.tier, len(task.fail_to_pass), task.lines_deleted, task.project)


TASK = TypeAdapter(Task)
INDEX_ENTRY = TypeAdapter(IndexEntry)


def schema_problem(e: ValidationError) -> str:
    """The first of pydantic's errors as 'field X: problem' (and how many more there are)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"])
    kind = first["type"]
    if kind == "json_invalid":
        problem = f"it is not JSON that can be read ({first['msg'].removeprefix('Invalid JSON: ')})"
    elif kind in ("dataclass_type", "dataclass_exact_type"):
        problem = f"{where or 'the file'} is not a JSON object"
    elif kind == "missing":
        problem = f"field '{where}' is missing"
    elif kind == "unexpected_keyword_argument":
        problem = f"field '{where}' is unknown"
    else:
        problem = f"field '{where}': {first['msg'][:1].lower()}{first['msg'][1:]}"
    more = len(errors) - 1
    return problem + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def path_problem(rel: object) -> str | None:
    """Why `rel` is not a relative POSIX path inside a repository (None if it is)."""
    if not isinstance(rel, str) or not rel:
        return "is not a relative path"
    if "\0" in rel or "\\" in rel:
        return f"{rel!r} is not a relative POSIX path (it holds a NUL byte or a backslash)"
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return f"{rel!r} is not a relative path inside the repository (no leading '/', '.', '..' or empty parts)"
    return None


def check_task(task: Task, task_dir: Path, where: str) -> None:
    """What the types cannot say (see the module docstring); TaskFormatError naming `where` and the field."""

    def bad(field_name: str, problem: str) -> TaskFormatError:
        return TaskFormatError(f"{where} is not a valid task file: field '{field_name}': {problem}; {RECREATE}")

    if task.id != task_dir.name:
        raise bad("id", f"{task.id!r} is not the task's directory name {task_dir.name!r}")
    try:
        check_name(task.id, "task id")
    except ValueError as e:
        raise bad("id", str(e)) from None
    if task.tier not in (1, 2, 3):
        raise bad("tier", f"{task.tier} is not 1, 2 or 3")
    if task.project is None and task.version >= 3:
        raise bad("project", "is missing (every task of format version 3 names its project)")
    if task.project is not None and (why := task.project.problem()):
        raise bad("project", why)
    for name in ("lines_deleted", "fingerprints"):
        if getattr(task, name) < 0:
            raise bad(name, "is negative")
    if not task.fail_to_pass:
        raise bad("fail_to_pass", "is empty (a task needs a test that fails without the deleted code; an empty list "
                                  "would reward the empty patch)")
    for i, rel in enumerate(task.test_files):
        why = path_problem(rel)
        if why:
            raise bad(f"test_files.{i}", why)
    if len(set(task.test_files)) != len(task.test_files):
        raise bad("test_files", "names a file twice")
    for i, d in enumerate(task.deleted):
        why = path_problem(d.file)
        if why:
            raise bad(f"deleted.{i}.file", why)
        if not 1 <= d.start <= d.end:
            raise bad(f"deleted.{i}", f"lines {d.start}-{d.end} are not a range of lines")
    restored = set(task.test_files)
    seen: set[str] = set()
    for name in ("fail_to_pass", "pass_to_pass"):
        for i, test in enumerate(getattr(task, name)):
            file = test.split("::", 1)[0]
            if "::" not in test or path_problem(file):
                raise bad(f"{name}.{i}", f"{test!r} is not a pytest node id (FILE::NAME)")
            if file not in restored:
                raise bad(f"{name}.{i}", f"{test!r} is in {file}, which is not one of test_files (the grader "
                                         "restores only those; a test anywhere else could be edited by the patch)")
            if test in seen:
                raise bad(f"{name}.{i}", f"{test!r} is listed twice (fail_to_pass and pass_to_pass are disjoint)")
            seen.add(test)
    _real_dir(task_dir, "tests")
    for rel in task.test_files:
        fd = _open_canonical(task_dir, rel)
        os.close(fd)


def _real_dir(task_dir: Path, name: str) -> None:
    try:
        st = os.lstat(task_dir / name)
    except FileNotFoundError:
        raise TaskFormatError(f"task {task_dir.name} lacks its {name}/ directory in {task_dir}; {RECREATE}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise TaskFormatError(f"task {task_dir.name}: {task_dir / name} is not a directory (a symbolic link or a "
                              f"file; it is not followed); {RECREATE}")


def _open_canonical(task_dir: Path, rel: str, limit: int = MAX_TEST_FILE) -> int:
    """An open descriptor of the regular file tests/`rel` of the task, reached without following any link."""
    where = f"task {task_dir.name}: canonical test file tests/{rel}"
    why = path_problem(rel)
    if why:
        raise TaskFormatError(f"{where}: {why}; {RECREATE}")
    *dirs, name = rel.split("/")
    try:
        parent = Tree(task_dir / "tests").open_dir(dirs)
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISLNK(st.st_mode) and not stat.S_ISREG(st.st_mode):
                raise TaskFormatError(f"{where} is not a regular file; {RECREATE}")
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        finally:
            os.close(parent)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TaskFormatError(f"{where} is, or lies under, a symbolic link (test files are not read through "
                                  f"links); {RECREATE}") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise TaskFormatError(f"{where} does not exist; {RECREATE}") from None
        raise TaskFormatError(f"{where} cannot be opened ({e.strerror}); {RECREATE}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        os.close(fd)
        problem = "is not a regular file" if not stat.S_ISREG(st.st_mode) else \
            f"is larger than {limit} bytes ({st.st_size})"
        raise TaskFormatError(f"{where} {problem}; {RECREATE}")
    return fd


def _read_fd(fd: int, limit: int) -> bytes | None:
    """At most `limit` bytes from `fd` (closed here); None if there is more."""
    try:
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                return None
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_canonical(task_dir: Path, rel: str, limit: int = MAX_TEST_FILE) -> bytes:
    """The task's canonical copy of the test file `rel` (a repository path): a regular file under `tests/`, reached
    without following any symbolic link, at most `limit` bytes; TaskFormatError otherwise."""
    _real_dir(Path(task_dir), "tests")
    data = _read_fd(_open_canonical(Path(task_dir), rel, limit), limit)
    if data is None:
        raise TaskFormatError(f"task {Path(task_dir).name}: canonical test file tests/{rel} is larger than {limit} "
                              f"bytes; {RECREATE}")
    return data


def read_capped(path: Path, limit: int) -> bytes:
    """The bytes of the regular file `path` (its last component not followed), at most `limit`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TaskFormatError(f"{path} is a symbolic link (task files are not read through links); "
                                  f"{RECREATE}") from None
        raise TaskFormatError(f"{path} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise TaskFormatError(f"{path} is not a regular file; {RECREATE}")
    data = _read_fd(fd, limit)
    if data is None:
        raise TaskFormatError(f"{path} is larger than {limit} bytes; no task set writes one that big; {RECREATE}")
    return data


def load_task(tasks_dir: Path, task_id: str) -> tuple[Task, Path]:
    try:
        check_name(task_id, "task id")
    except ValueError as e:
        raise TaskFormatError(f"{e} (a task id is a directory name in the task set {tasks_dir})") from None
    task_dir = Path(tasks_dir) / task_id
    path = task_dir / "task.json"
    if not os.path.lexists(path):
        known = sorted(p.name for p in Path(tasks_dir).iterdir() if (p / "task.json").is_file()) \
            if Path(tasks_dir).is_dir() else []
        raise TaskFormatError(f"no task '{task_id}' in {tasks_dir} (no {path}); tasks there: "
                              f"{', '.join(known[:10]) or 'none'}{' …' if len(known) > 10 else ''}")
    data = read_capped(path, MAX_TASK_JSON)
    try:
        raw = from_json(data)
    except ValueError:
        raw = None  # the schema below says what is wrong with it
    if isinstance(raw, dict) and "version" in raw and raw["version"] not in READ_VERSIONS:
        raise TaskFormatError(f"{path} has format version {str(raw['version'])[:20]}; this shipyard reads "
                              f"{' and '.join(map(str, READ_VERSIONS))}: {RECREATE}")
    try:
        task = TASK.validate_json(data)
    except ValidationError as e:
        raise TaskFormatError(f"{path} is not a valid task file: {schema_problem(e)}; {RECREATE}") from None
    if task.project is None and task.version < 3:
        task.project = project_from_source(task.source)
    check_task(task, task_dir, str(path))
    _real_dir(task_dir, "snapshot")
    return task, task_dir


def index_entries(tasks_dir: Path) -> list[IndexEntry]:
    """The lines of the task set's `tasks.jsonl`, each checked; TaskFormatError naming the line otherwise."""
    index = Path(tasks_dir) / "tasks.jsonl"
    if not index.is_file():
        raise TaskFormatError(f"{tasks_dir} is not a task set (no tasks.jsonl); make one with `shipyard synth`")
    entries, seen = [], set()
    for number, line in enumerate(read_capped(index, MAX_INDEX).splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = INDEX_ENTRY.validate_json(line)
            check_name(entry.id, "task id")
        except ValidationError as e:
            raise TaskFormatError(f"{index} line {number}: {schema_problem(e)}; {RECREATE}") from None
        except ValueError as e:
            raise TaskFormatError(f"{index} line {number}: {e}; {RECREATE}") from None
        if entry.project is not None and (why := entry.project.problem()):
            raise TaskFormatError(f"{index} line {number}: project {why}; {RECREATE}")
        if entry.id in seen:
            raise TaskFormatError(f"{index} line {number}: task {entry.id!r} is listed twice; {RECREATE}")
        seen.add(entry.id)
        entries.append(entry)
    return entries


def list_tasks(tasks_dir: Path) -> list[str]:
    return [entry.id for entry in index_entries(tasks_dir)]


def task_projects(tasks_dir: Path) -> dict[str, str]:
    """Task id → its project's name, for every task of the set: from the index, or from the task itself where the
    index line does not say (version-2 task sets)."""
    return {e.id: e.project.name if e.project is not None else load_task(tasks_dir, e.id)[0].project.name
            for e in index_entries(tasks_dir)}



def synth_reports(tasks_dir: Path) -> dict[str, dict[str, Any]]:
    """Project name → its synthesis report, from the task set's synth.json (`{"projects": {...}}`; a file of one
    report, as sets made before several projects were written, counts as that report's project). Empty when there
    is no synth.json."""
    path = Path(tasks_dir) / "synth.json"
    if not os.path.lexists(path):
        return {}
    try:
        doc = json.loads(read_capped(path, MAX_INDEX))
    except (ValueError, RecursionError) as e:
        raise TaskFormatError(f"{path} is not JSON that can be read ({str(e)[:100]}); {RECREATE}") from None
    if isinstance(doc, dict) and isinstance(doc.get("projects"), dict) and \
            all(isinstance(r, dict) for r in doc["projects"].values()):
        return doc["projects"]
    if isinstance(doc, dict) and isinstance(doc.get("repo"), str):
        return {project_from_source({"repo": doc["repo"]}).name: doc}
    raise TaskFormatError(f"{path} is not a synthesis record (an object with 'projects'); {RECREATE}")


def claim(tasks_dir: Path, project: Project) -> set[str]:
    """The ids the task set `tasks_dir` already lists (none when it is new); TaskSetConflict when it already holds
    tasks of `project`."""
    index = Path(tasks_dir) / "tasks.jsonl"
    entries = index_entries(tasks_dir) if os.path.lexists(index) else []
    reports = synth_reports(tasks_dir)
    ids = {e.id for e in entries}
    held = [e.id for e in entries if e.project is not None and e.project.name == project.name]
    held += [t for t in reports.get(project.name, {}).get("accepted", []) if t in ids]
    if held:
        raise TaskSetConflict(f"the task set {tasks_dir} already holds {len(set(held))} tasks of {project.name} "
                              f"(e.g. {held[0]}): synthesize it into another set, or remove those tasks first")
    return ids


def append_project(tasks_dir: Path, entries: list[IndexEntry], project: Project, report: dict[str, Any]) -> None:
    """Add one project's synthesis to the task set: its tasks' lines appended to tasks.jsonl, its report put under
    its name in synth.json (rewritten whole, through a temporary file and a rename). The index first: a set cut
    short in between lists tasks without their report, and `claim` still refuses to synthesize the project again."""
    tasks_dir = Path(tasks_dir)
    reports = synth_reports(tasks_dir)
    with open(tasks_dir / "tasks.jsonl", "a") as f:
        f.write("".join(json.dumps(asdict(e)) + "\n" for e in entries))
    reports[project.name] = report
    tmp = tasks_dir / "synth.json.tmp"
    tmp.write_text(json.dumps({"projects": reports}, indent=2) + "\n")
    tmp.replace(tasks_dir / "synth.json")
