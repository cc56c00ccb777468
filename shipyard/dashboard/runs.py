"""What the dashboard reads: run directories (`shipyard.rl.rundir`), their eval results and task sets — by name,
incrementally, and never outside the directories the operator named.

**Names, not paths.** A client names a run (a directory under `--runs` holding run.json, or `--runs` itself)
and within it a step and a rollout's position; the server maps names it listed itself onto paths. A name is one
path component of `[A-Za-z0-9._-]`, and the path it maps to must resolve inside the root — so `..`, an absolute
path, a symlink out of the root or a name that was never listed is refused (`NotFound`), whatever the client
sends. A run's task set is the one its config.toml names (the operator's file); its tasks are again looked up by
the ids it lists.

**Thousands of trajectories, loaded one at a time.** The trajectory list comes from rollouts.jsonl (one short line
per rollout: task, reward, status, flags, step), read incrementally — each refresh parses only the lines appended
since the last (`Tail`) — and filtered and paged in memory (a few hundred bytes per rollout). A rollout's full record
(its turns, tool outputs, patch, hints and monitor evidence) is parsed from trajectories/step-N.jsonl only when
opened: the n-th rollout of a step is the n-th line of its file (both are written in batch order). Metrics are read
the same way from a byte offset the client keeps, so live updates cost what was appended.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
MAX_LINE = 64 << 20  # a trajectory line longer than this is not shown (a run writes ~10-500 KB per rollout)
SUMMARY_KEYS = ("task", "group", "index", "status", "reward", "advantage", "monitor_flags", "stop_reason", "turns",
                "tool_calls", "hints", "staleness", "total_seconds", "sampled_tokens")


class NotFound(LookupError):
    """No such run, step, rollout, eval or task under the dashboard's roots (or a name that is not one)."""


def _inside(root: Path, name: str) -> Path:
    """`root / name` for a listed-looking name that resolves inside `root`; NotFound otherwise."""
    if not NAME.fullmatch(name) or name in (".", ".."):
        raise NotFound(f"{name!r} is not a name this dashboard lists")
    path = (root / name).resolve()
    if path != root and not path.is_relative_to(root):
        raise NotFound(f"{name!r} is outside the dashboard's directory")
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise NotFound(f"{path.name}: unreadable ({type(e).__name__})") from None


def read_from(path: Path, offset: int, limit: int = 8 << 20) -> tuple[list[dict[str, Any]], int]:
    """Whole JSON lines of `path` from byte `offset` (at most ~`limit` bytes; a line without its newline yet is left
    for the next call): (rows, the offset to ask from next). An offset past the end — the file was rewritten on
    resume — starts over from 0. A line cut short by a crash is skipped, as `RunDir.resume` does."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [], 0
    if not 0 <= offset <= size:
        offset = 0
    with path.open("rb") as f:
        f.seek(offset)
        chunk = f.read(min(size - offset, limit))
    end = chunk.rfind(b"\n") + 1
    rows = []
    for raw in chunk[:end].splitlines():
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows, offset + end


@dataclass
class Tail:
    """A JSON-lines file read incrementally: `lines()` parses only what was appended since the last call, and
    starts over when the file shrank (a resumed run rewrites its logs)."""

    path: Path
    offset: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)

    def lines(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size < self.offset:
            self.offset, self.rows = 0, []
        while self.offset < size:
            rows, offset = read_from(self.path, self.offset)
            if offset <= self.offset:  # a partial last line, or the file shrank meanwhile (the next call starts over)
                break
            self.rows += rows
            self.offset = offset
        return self.rows


class Run:
    """One run directory, read on demand."""

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self._rollouts = Tail(path / "rollouts.jsonl")

    def summary(self) -> dict[str, Any]:
        status = _read_json(self.path / "run.json")
        config = self.config()
        return {"name": self.name, "status": status.get("status"), "step": status.get("step"),
                "started": status.get("started"), "updated": status.get("updated"), "error": status.get("error"),
                "model": config.get("model", {}).get("name"), "steps": config.get("run", {}).get("steps"),
                "hints": config.get("hints", {}).get("enabled")}

    def config(self) -> dict[str, Any]:
        try:
            return tomllib.loads((self.path / "config.toml").read_text())
        except (OSError, tomllib.TOMLDecodeError):
            return {}

    def metrics(self, offset: int) -> dict[str, Any]:
        rows, next_offset = read_from(self.path / "metrics.jsonl", offset)
        return {"rows": rows, "offset": next_offset}

    def rollouts(self) -> list[dict[str, Any]]:
        """Every rollout's summary, with `step` and `position` (its line in the step's trajectory file)."""
        rows = self._rollouts.lines()
        counts: dict[int, int] = {}
        out = []
        for row in rows:
            step = row.get("step")
            if not isinstance(step, int):
                continue
            position = counts.get(step, 0)
            counts[step] = position + 1
            out.append({"step": step, "position": position, **{k: row.get(k) for k in SUMMARY_KEYS}})
        return out

    def trajectory(self, step: int, position: int) -> dict[str, Any]:
        path = self.path / "trajectories" / f"step-{step:06d}.jsonl"
        if step < 0 or position < 0 or not path.is_file():
            raise NotFound(f"run {self.name} has no trajectories of step {step}")
        with path.open("rb") as f:
            for n, raw in enumerate(f):
                if n == position:
                    if len(raw) > MAX_LINE:
                        raise NotFound(f"rollout {position} of step {step} is over {MAX_LINE >> 20} MiB")
                    try:
                        return json.loads(raw)
                    except ValueError:
                        raise NotFound(f"rollout {position} of step {step} is not readable JSON") from None
        raise NotFound(f"step {step} of run {self.name} has no rollout {position}")

    def evals(self) -> list[str]:
        return sorted(p.stem for p in (self.path / "eval").glob("step-*.json"))

    def eval(self, name: str) -> dict[str, Any]:
        if not re.fullmatch(r"step-\d{6}", name):
            raise NotFound(f"{name!r} is not an eval of run {self.name}")
        path = self.path / "eval" / f"{name}.json"
        if not path.is_file():
            raise NotFound(f"run {self.name} has no eval {name}")
        return _read_json(path)

    def tasks_dir(self) -> Path | None:
        tasks = self.config().get("run", {}).get("tasks")
        path = Path(tasks) if tasks else self.path / "tasks"
        return path if path.is_dir() else None

    def tasks(self) -> list[dict[str, Any]]:
        root = self.tasks_dir()
        if root is None:
            return []
        held_out = set(self.config().get("run", {}).get("held_out", ()))
        out = []
        for d in sorted(root.iterdir()):
            if (d / "task.json").is_file() and NAME.fullmatch(d.name):
                try:
                    doc = json.loads((d / "task.json").read_text())
                except (OSError, ValueError):
                    continue
                out.append({"id": d.name, "tier": doc.get("tier"), "held_out": d.name in held_out,
                            "deleted": [f"{s.get('file')}:{s.get('qualname')}" for s in doc.get("deleted", [])
                                        if isinstance(s, dict)]})
        return out

    def task(self, task_id: str) -> dict[str, Any]:
        root = self.tasks_dir()
        if root is None:
            raise NotFound(f"run {self.name} names no task set that exists")
        path = _inside(root.resolve(), task_id)
        if not (path / "task.json").is_file():
            raise NotFound(f"no task {task_id!r} in run {self.name}'s task set")
        doc = _read_json(path / "task.json")
        tests = {}  # the files of the tests the task must make pass, as the grader restores them
        test_root = (path / "tests").resolve()
        for node in doc.get("fail_to_pass", []):
            name = str(node).split("::")[0]
            file = (test_root / name).resolve()
            if name in tests or not file.is_relative_to(test_root) or not file.is_file():
                continue
            tests[name] = file.read_text(errors="replace")[:256 << 10]
        return {"id": task_id, "task": doc, "tests": tests}


class Runs:
    """The runs under `root`: `root` itself when it is a run directory, else each subdirectory that is one."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise NotFound(f"--runs {root} is not a directory")
        self._open: dict[str, Run] = {}

    def paths(self) -> dict[str, Path]:
        """Run name → directory: the root's own name when it is a run, else each subdirectory that is one."""
        if (self.root / "run.json").is_file():
            return {self.root.name if NAME.fullmatch(self.root.name) else "run": self.root}
        return {d.name: _inside(self.root, d.name) for d in sorted(self.root.iterdir())
                if NAME.fullmatch(d.name) and (d / "run.json").is_file() and d.resolve().is_relative_to(self.root)}

    def get(self, name: str) -> Run:
        paths = self.paths()
        if name not in paths:
            raise NotFound(f"no run {name!r} under {self.root}")
        if name not in self._open or self._open[name].path != paths[name]:
            self._open[name] = Run(name, paths[name])
        return self._open[name]

    def list(self) -> list[dict[str, Any]]:
        out = []
        for name in self.paths():
            try:
                out.append(self.get(name).summary())
            except NotFound as e:
                out.append({"name": name, "status": "unreadable", "error": str(e)})
        return out


def page(rows: list[dict[str, Any]], *, task: str | None = None, step: int | None = None,
         min_reward: float | None = None, max_reward: float | None = None, flagged: bool | None = None,
         hinted: bool | None = None, offset: int = 0, limit: int = 50) -> dict[str, Any]:
    """Filter rollout summaries and return one page (newest step first), with the total that matched."""
    def keep(r: dict[str, Any]) -> bool:
        reward = r.get("reward")
        return ((task is None or r.get("task") == task) and (step is None or r.get("step") == step)
                and (min_reward is None or (reward is not None and reward >= min_reward))
                and (max_reward is None or (reward is not None and reward <= max_reward))
                and (flagged is None or bool(r.get("monitor_flags")) == flagged)
                and (hinted is None or bool(r.get("hints")) == hinted))

    matched = [r for r in reversed(rows) if keep(r)]
    limit = max(1, min(limit, 500))
    offset = max(0, offset)
    return {"total": len(matched), "offset": offset, "rows": matched[offset:offset + limit]}
