"""What the dashboard reads: run directories (`shipyard.rl.rundir`), their eval results and task sets — by name,
incrementally, and never outside the directories the operator named.

**Names, not paths; no links.** A client names a run (a directory under `--runs` holding run.json, or `--runs`
itself) and within it a step, a rollout's position, an eval or a task; the server maps names it listed itself onto
files. A name is one path component of `[A-Za-z0-9._-]`. Every file is then opened through
`shipyard.harness.confined.Tree` — each component below the root opened with `O_NOFOLLOW`, only regular files,
`lstat` before `open` and `fstat` after, sizes capped — so a symbolic link planted in a run directory or a task set
(`trajectories/step-000001.jsonl -> ~/.ssh/id_ed25519`, a `tests` directory linked elsewhere), a FIFO or a huge file
is refused (`NotFound`), whatever the client sends. The roots themselves are the operator's: `--runs` and the task set
a run's config.toml names (`run.tasks`).

**Thousands of trajectories, loaded one at a time.** The trajectory list comes from rollouts.jsonl (one short line
per rollout: task, reward, status, flags, hints, step), read incrementally — each refresh parses only the lines
appended since the last (`Tail`), and starts over when the file was replaced (a resumed run rewrites its logs: a new
inode) — then filtered and paged in memory (a few hundred bytes per rollout). A rollout's full record (its turns,
tool outputs, patch, hints and monitor evidence) is parsed from trajectories/step-N.jsonl only when opened: the n-th
rollout of a step is the n-th line of its file (both are written in batch order). Metrics are read the same way from
a byte offset the page keeps, with the file's identity, so live updates cost what was appended.
"""

from __future__ import annotations

import json
import os
import re
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shipyard.harness.confined import PathError, Tree

NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
EVAL = re.compile(r"^step-[0-9]{6}$")
MAX_JSON = 64 << 20  # run.json, config.toml, an eval, a task.json: far below this
MAX_LINE = 64 << 20  # one trajectory record (a run writes ~10-500 KB per rollout)
MAX_CHUNK = 8 << 20  # JSON lines parsed per read of a log
MAX_TEST_FILE = 1 << 20
SUMMARY_KEYS = ("task", "group", "index", "status", "reward", "advantage", "monitor_flags", "stop_reason", "turns",
                "tool_calls", "hints", "staleness", "total_seconds", "sampled_tokens")


class NotFound(LookupError):
    """No such run, step, rollout, eval or task under the dashboard's roots, or one that cannot be read safely (a
    link, not a regular file, too large, not JSON)."""


def _check_name(name: str, what: str) -> str:
    if not NAME.fullmatch(name) or name in (".", ".."):
        raise NotFound(f"{what} {name[:80]!r} is not a name this dashboard lists")
    return name


@contextmanager
def _reading(rel: str) -> Iterator[None]:
    """`Tree`'s refusals as NotFound. Its messages are written for a model (`confined.error_for`: a missing file
    too is a PathError), so they are summed up here."""
    try:
        yield
    except (ValueError, OSError) as e:  # PathError is a ValueError; so is a NUL in a name
        raise NotFound(f"{rel} does not exist or cannot be read safely (a link, not a regular file, or too large: "
                       f"{type(e).__name__})") from None


def _open(tree: Tree, rel: str) -> int:
    with _reading(rel):
        return tree.open_regular(rel)


def _read(tree: Tree, rel: str, limit: int = MAX_JSON) -> bytes:
    with _reading(rel):
        return tree.read(rel, limit)


def _json(tree: Tree, rel: str) -> Any:
    try:
        return json.loads(_read(tree, rel))
    except ValueError:
        raise NotFound(f"{rel} is not JSON") from None


def _table(doc: Any, key: str) -> dict[str, Any]:
    """`doc[key]` when both are tables, else empty: config.toml and task.json are read, not trusted to be well
    formed."""
    value = doc.get(key) if isinstance(doc, dict) else None
    return value if isinstance(value, dict) else {}


def _items(doc: dict[str, Any], key: str) -> list[Any]:
    value = doc.get(key)
    return value if isinstance(value, list) else []


def read_from(tree: Tree, rel: str, offset: int, identity: str | None = None) -> tuple[list[dict[str, Any]], int, str]:
    """Whole JSON lines of `rel` from byte `offset` (at most ~`MAX_CHUNK` bytes; a line without its newline yet is
    left for the next call): (rows, the offset to ask from next, the file's identity). When `identity` (the one a
    previous call returned) is not the file's any more — it was replaced: a resumed run rewrites its logs — or the
    offset is past its end, reading starts over from 0. A line longer than `MAX_CHUNK` is skipped, as is one cut
    short by a crash (`RunDir.resume` drops those too). A missing file reads as empty."""
    try:
        fd = _open(tree, rel)
    except NotFound:
        return [], 0, ""
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        current = f"{st.st_dev}:{st.st_ino}"
        if identity not in (None, current) or not 0 <= offset <= st.st_size:
            offset = 0
        f.seek(offset)
        chunk = f.read(MAX_CHUNK)
        end = chunk.rfind(b"\n") + 1
        if end == 0 and len(chunk) == MAX_CHUNK:  # one line longer than a whole chunk: skip past it
            skipped = offset + len(chunk)
            while block := f.read(1 << 20):
                if (newline := block.find(b"\n")) != -1:
                    return [], skipped + newline + 1, current
                skipped += len(block)
            return [], offset, current  # still being written: wait for its end
    rows = []
    for raw in chunk[:end].splitlines():
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows, offset + end, current


@dataclass
class Tail:
    """A JSON-lines file of a tree read incrementally: `lines()` parses only what was appended since the last call,
    and starts over when the file was replaced or shrank. One reader at a time (polls may overlap)."""

    tree: Tree
    rel: str
    offset: int = 0
    identity: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def lines(self) -> list[dict[str, Any]]:
        with self.lock:
            while True:
                rows, offset, identity = read_from(self.tree, self.rel, self.offset, self.identity)
                restarted = identity != self.identity or offset < self.offset
                if restarted:
                    self.rows = []
                self.rows += rows
                done = not restarted and offset == self.offset
                self.offset, self.identity = offset, identity
                if done:
                    return list(self.rows)


class Run:
    """One run directory (`tree`: the folder given to the dashboard; `name`: the run's directory in it, "." when the
    folder is the run), read on demand."""

    def __init__(self, name: str, tree: Tree, base: str):
        self.name, self.tree, self.base = name, tree, base
        self._rollouts = Tail(tree, self._rel("rollouts.jsonl"))

    def _rel(self, *parts: str) -> str:
        return "/".join(p for p in (self.base, *parts) if p != ".")

    def summary(self) -> dict[str, Any]:
        status = _json(self.tree, self._rel("run.json"))
        if not isinstance(status, dict):
            raise NotFound("run.json is not a run's status")
        config = self.config()
        return {"name": self.name, "status": status.get("status"), "step": status.get("step"),
                "started": status.get("started"), "updated": status.get("updated"), "error": status.get("error"),
                "model": _table(config, "model").get("name"), "steps": _table(config, "run").get("steps"),
                "hints": _table(config, "hints").get("enabled")}

    def config(self) -> dict[str, Any]:
        try:
            return tomllib.loads(_read(self.tree, self._rel("config.toml")).decode())
        except (NotFound, UnicodeDecodeError, tomllib.TOMLDecodeError):
            return {}

    def metrics(self, offset: int, identity: str | None = None) -> dict[str, Any]:
        rows, next_offset, current = read_from(self.tree, self._rel("metrics.jsonl"), offset, identity)
        return {"rows": rows, "offset": next_offset, "file": current,
                "reset": identity not in (None, current) or next_offset < offset}

    def rollouts(self) -> list[dict[str, Any]]:
        """Every rollout's summary, with `step` and `position` (its line in the step's trajectory file)."""
        counts: dict[int, int] = {}
        out = []
        for row in self._rollouts.lines():
            step = row.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            position = counts.get(step, 0)
            counts[step] = position + 1
            summary = {k: row.get(k) for k in SUMMARY_KEYS}
            if not isinstance(summary["task"], str):
                summary["task"] = None
            out.append({"step": step, "position": position, **summary})
        return out

    def trajectory(self, step: int, position: int) -> dict[str, Any]:
        rel = self._rel("trajectories", f"step-{step:06d}.jsonl")
        fd = _open(self.tree, rel)
        with os.fdopen(fd, "rb") as f:
            for n in range(position + 1):
                raw = f.readline(MAX_LINE + 1)
                if not raw:
                    raise NotFound(f"step {step} of run {self.name} has no rollout {position}")
                if len(raw) > MAX_LINE and not raw.endswith(b"\n"):
                    if n == position:
                        raise NotFound(f"rollout {position} of step {step} is over {MAX_LINE >> 20} MiB")
                    while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                        pass
        try:
            record = json.loads(raw)
        except ValueError:
            raise NotFound(f"rollout {position} of step {step} is not readable JSON") from None
        if not isinstance(record, dict):
            raise NotFound(f"rollout {position} of step {step} is not a rollout record")
        return record

    def evals(self) -> list[str]:
        try:
            fd = self.tree.open_dir(Tree.parts(self._rel("eval") or "."))
        except (PathError, OSError):
            return []
        try:
            return sorted(n[:-5] for n in os.listdir(fd) if n.endswith(".json") and EVAL.fullmatch(n[:-5]))
        finally:
            os.close(fd)

    def eval(self, name: str) -> dict[str, Any]:
        if not EVAL.fullmatch(name):
            raise NotFound(f"{name[:80]!r} is not an eval of run {self.name}")
        doc = _json(self.tree, self._rel("eval", f"{name}.json"))
        if not isinstance(doc, dict):
            raise NotFound(f"eval {name} of run {self.name} is not an eval result")
        return doc

    def task_tree(self) -> Tree | None:
        """The run's task set: `run.tasks` in its config (relative to the run), else RUN/tasks. One inside the runs
        folder is reached without following a link, like every file there; one outside it is the operator's."""
        run_dir = self.tree.root / self._rel() if self.base != "." else self.tree.root
        named = _table(self.config(), "run").get("tasks")
        path = Path(os.path.normpath(run_dir / named)) if isinstance(named, str) and named else run_dir / "tasks"
        if path.is_relative_to(self.tree.root):
            rel = str(path.relative_to(self.tree.root)) or "."
            try:
                os.close(self.tree.open_dir(Tree.parts(rel)))
            except (ValueError, OSError):
                return None
            return Tree(path)
        path = path.resolve()
        return Tree(path) if path.is_dir() else None

    def tasks(self) -> list[dict[str, Any]]:
        tree = self.task_tree()
        if tree is None:
            return []
        held_out = {t for t in _items(_table(self.config(), "run"), "held_out") if isinstance(t, str)}
        out = []
        for entry in sorted(os.scandir(tree.root), key=lambda e: e.name):
            if not NAME.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                doc = _json(tree, f"{entry.name}/task.json")
            except NotFound:
                continue
            if isinstance(doc, dict):
                out.append({"id": entry.name, "tier": doc.get("tier"), "held_out": entry.name in held_out,
                            "deleted": [f"{d.get('file')}:{d.get('qualname')}" for d in _items(doc, "deleted")
                                        if isinstance(d, dict)]})
        return out

    def task(self, task_id: str) -> dict[str, Any]:
        tree = self.task_tree()
        if tree is None:
            raise NotFound(f"run {self.name} names no task set that exists")
        _check_name(task_id, "task")
        doc = _json(tree, f"{task_id}/task.json")
        if not isinstance(doc, dict):
            raise NotFound(f"task {task_id} has no task record")
        tests = {}  # the files of the tests the task must make pass, as the grader restores them (no link followed)
        for node in _items(doc, "fail_to_pass"):
            name = str(node).split("::")[0]
            if name in tests or len(tests) >= 20:
                continue
            try:
                tests[name] = _read(tree, f"{task_id}/tests/{'/'.join(Tree.parts(name))}",
                                    MAX_TEST_FILE).decode(errors="replace")
            except (NotFound, ValueError):  # a link, a special file, a NUL or `..` in the name
                continue
        return {"id": task_id, "task": doc, "tests": tests}


class Runs:
    """The runs under `root`: `root` itself when it is a run directory, else each subdirectory that is one (a
    symbolic link is not)."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise NotFound(f"--runs {root} is not a directory")
        self.tree = Tree(self.root)
        self._open: dict[str, Run] = {}

    def bases(self) -> dict[str, str]:
        """Run name → its directory relative to the root ("." for the root itself)."""
        if (self.root / "run.json").is_file():
            return {self.root.name if NAME.fullmatch(self.root.name) else "run": "."}
        def is_run(entry: os.DirEntry) -> bool:
            status = os.path.join(entry.path, "run.json")
            return (NAME.fullmatch(entry.name) is not None and entry.is_dir(follow_symlinks=False)
                    and os.path.isfile(status) and not os.path.islink(status))

        return {e.name: e.name for e in sorted(os.scandir(self.root), key=lambda e: e.name) if is_run(e)}

    def get(self, name: str) -> Run:
        bases = self.bases()
        if name not in bases:
            raise NotFound(f"no run {name[:80]!r} under {self.root}")
        if name not in self._open or self._open[name].base != bases[name]:
            self._open[name] = Run(name, self.tree, bases[name])
        return self._open[name]

    def list(self) -> list[dict[str, Any]]:
        out = []
        for name in self.bases():
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
        number = isinstance(reward, int | float) and not isinstance(reward, bool)
        return ((task is None or r.get("task") == task) and (step is None or r.get("step") == step)
                and (min_reward is None or (number and reward >= min_reward))
                and (max_reward is None or (number and reward <= max_reward))
                and (flagged is None or bool(r.get("monitor_flags")) == flagged)
                and (hinted is None or bool(r.get("hints")) == hinted))

    matched = [r for r in reversed(rows) if keep(r)]
    limit = max(1, min(limit, 500))
    offset = max(0, offset)
    return {"total": len(matched), "offset": offset, "rows": matched[offset:offset + limit]}
