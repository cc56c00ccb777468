"""The task-set directory format (documented for users in docs/tasks.md).

    TASKS_DIR/
      tasks.jsonl            one line per task: {"id", "tier", "fail_to_pass", "lines_deleted"} (an index)
      synth.json             the synthesis run: yield, rejection reasons and counts, timings
      <task-id>/
        task.json            `Task` below
        snapshot/            the scrubbed, agent-visible repository (one fresh commit, `.venv` prepared)
        gold.patch           restores the deleted code (`git diff`, paths relative to the snapshot root)
        tests/               canonical copies of the test files and test configuration, by their repo path

`gold.patch` and `tests/` are never inside `snapshot/`: nothing an agent can read reveals the answer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TASK_VERSION = 1


class TaskFormatError(ValueError):
    """A task directory or task.json is malformed; the message names the file and the problem."""


@dataclass
class DeletedSymbol:
    file: str
    qualname: str
    start: int
    end: int


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
    test_command: str = ".venv/bin/python -m pytest -p no:cacheprovider"
    test_files: list[str] = field(default_factory=list)  # repo paths restored from tests/ before grading
    fingerprints: int = 0  # how many unique fingerprints of the deleted code the leak scan searched for
    validation: list[dict[str, Any]] = field(default_factory=list)  # each step: name, ok, seconds, details
    version: int = TASK_VERSION

    @property
    def symbols(self) -> list[str]:
        return [f"{d.file}:{d.qualname}" for d in self.deleted]

    def save(self, task_dir: Path) -> None:
        (task_dir / "task.json").write_text(json.dumps(asdict(self), indent=2) + "\n")


def load_task(tasks_dir: Path, task_id: str) -> tuple[Task, Path]:
    task_dir = Path(tasks_dir) / task_id
    path = task_dir / "task.json"
    if not path.is_file():
        known = sorted(p.name for p in Path(tasks_dir).iterdir() if (p / "task.json").is_file()) \
            if Path(tasks_dir).is_dir() else []
        raise TaskFormatError(f"no task '{task_id}' in {tasks_dir} (no {path}); tasks there: "
                              f"{', '.join(known[:10]) or 'none'}{' …' if len(known) > 10 else ''}")
    try:
        raw = json.loads(path.read_text())
        raw["deleted"] = [DeletedSymbol(**d) for d in raw["deleted"]]
        task = Task(**raw)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise TaskFormatError(f"{path} is not a valid task file ({type(e).__name__}: {e}); re-create it with "
                              "`shipyard synth`") from e
    if task.version != TASK_VERSION:
        raise TaskFormatError(f"{path} has format version {task.version}; this shipyard reads {TASK_VERSION}")
    for needed in ("snapshot", "tests"):
        if not (task_dir / needed).is_dir():
            raise TaskFormatError(f"task {task_id} lacks its {needed}/ directory in {task_dir}")
    return task, task_dir


def list_tasks(tasks_dir: Path) -> list[str]:
    index = Path(tasks_dir) / "tasks.jsonl"
    if not index.is_file():
        raise TaskFormatError(f"{tasks_dir} is not a task set (no tasks.jsonl); make one with `shipyard synth`")
    return [json.loads(line)["id"] for line in index.read_text().splitlines() if line.strip()]
