"""Task directories named by environment-server clients: opened safely, and their snapshots cached for grading.

A rollout worker on another machine names a task by its directory on the server's host (`TASKS_DIR/ID`, the format
of `shipyard.tasks.taskset`). The server then needs two things from it: the task's files (task.json, gold.patch,
the canonical tests the grader restores) and a sandbox snapshot of its `snapshot/` (the repository the agent edits
and the grader tests). Both come from a path a client chose, so:

* **Judged as written, opened as judged** (`open_task`). The path must be absolute, free of `..` components and NUL
  bytes, and lie under one of the operator's `--allow-root`s. It is then opened by walking from that root one
  component at a time with `O_NOFOLLOW`, so a symbolic link anywhere on the way is refused (403) and the walk never
  leaves the root. Every later read goes through what the walk opened: the task is read through a private symbolic
  link named like the task that points at `/proc/self/fd/N` of the opened directory, so `load_task`, the grader's
  reads and the snapshot copy all reach exactly the directory that was checked, even if someone swaps a directory
  on the path for a link meanwhile (resolving first and opening later loses that race: see docs/security.md §4).
* **A task is checked like any other input.** `taskset.load_task` (one schema, `check_task`, files read without
  following links) decides; a malformed task is a `TaskRefused` with status 400 and load_task's own message, the
  private link's path replaced by the path the client gave — no host path the client did not write comes back.
* **Snapshots are cached** (`TaskSnapshots`): one copy per task, made by the first request that needs it (concurrent
  first requests wait for that one copy), reused by every sandbox and every grade after it — the grader's
  `snapshot=` — so no request copies the repository again. The key is the client's path plus a fingerprint of the
  opened directory and of `task.json`, `gold.patch`, `snapshot/` and `tests/` (device, inode, size, mtime and ctime
  of each, read with `lstat`): a task replaced on disk — a file rewritten, a directory swapped for a new one — is
  copied again, never served stale (the old copy is removed once nothing uses it). An edit deep inside `snapshot/`
  that leaves those five entries untouched is not seen: task sets are written whole, by `shipyard synth`, not edited
  in place. The cache is bounded in entries and bytes, least recently used first; a snapshot in use by a sandbox or
  a grade is never removed under it, so the bound can be exceeded by as many as are in use. `close` removes every
  copy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shipyard.sandbox.host import Host
from shipyard.sandbox.snapshot import Beneath, CopyBounds, SnapshotRefused, make_snapshot, open_beneath, remove_snapshot
from shipyard.tasks.taskset import Task, TaskFormatError, load_task

FINGERPRINTED = ("task.json", "gold.patch", "snapshot", "tests")


class TaskRefused(Exception):
    """A task directory the server will not use: `status` is the HTTP status, the message says why (and names only
    the path the client gave)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class OpenTask:
    """A task directory opened without following any link and held open; `dir` reaches exactly it."""

    given: str  # the path as the client wrote it
    fd: int
    dir: Path  # a private link named like the task, to /proc/self/fd/{fd}
    task: Task
    fingerprint: tuple

    @property
    def key(self) -> str:
        """The cache key: the path as written, normalised (`a//b/` and `a/b` are one task)."""
        return os.path.normpath(self.given)

    def hide(self, text: str) -> str:
        """`text` with the private paths this task is read through replaced by the path the client gave."""
        text = text.replace(str(self.dir), self.given).replace(f"/proc/self/fd/{self.fd}", self.given)
        return text.replace(str(self.dir.parent), os.path.dirname(self.key))


def _walk(raw: str, roots: Sequence[Path]) -> int:
    """The directory `raw` names, opened by walking from its allowed root without following a link."""
    if "\x00" in raw:
        raise TaskRefused(422, "the task path must not contain a NUL character")
    if not os.path.isabs(raw):
        raise TaskRefused(422, f"the task path {raw!r} must be absolute (a task directory on the server's host)")
    if ".." in raw.split("/"):
        raise TaskRefused(422, f"the task path {raw!r} must not contain '..': give the task directory's real path")
    try:
        return open_beneath(raw, roots)
    except Beneath as e:  # worded without the link's target: a client learns nothing of the host beyond its path
        if e.kind == "outside":
            allowed = ", ".join(map(str, roots)) or "none"
            raise TaskRefused(403, f"{raw} is outside the directories this server may read tasks from (allowed "
                                   f"roots: {allowed}); the operator allows more with `shipyard env-server "
                                   "--allow-root DIR`") from None
        if e.kind == "link":
            raise TaskRefused(403, f"{raw} goes through a symbolic link ({e.where}); task directories are not "
                                   "followed through links: give the directory's real path") from None
        if e.kind == "missing":
            raise TaskRefused(404, f"{raw} is not a directory ({e.where}: {e.strerror})") from None
        raise TaskRefused(403, f"{raw} cannot be opened ({e.where}: {e.strerror})") from None


def fingerprint(fd: int) -> tuple:
    """What changes when the task in the open directory `fd` is replaced (see the module docstring)."""
    def ident(st: os.stat_result | None) -> tuple | None:
        return st and (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    parts = [ident(os.fstat(fd))]
    for name in FINGERPRINTED:
        try:
            parts.append(ident(os.stat(name, dir_fd=fd, follow_symlinks=False)))
        except FileNotFoundError:
            parts.append(None)
    return tuple(parts)


@contextlib.contextmanager
def open_task(raw: str, roots: Sequence[Path], links: Path) -> Iterator[OpenTask]:
    """The task directory `raw` (a client's path), checked and loaded; `links` is a private directory of the
    server's. TaskRefused for anything it will not use."""
    fd = _walk(raw, roots)
    holder = links / uuid.uuid4().hex
    try:
        name = os.path.basename(os.path.normpath(raw)) or "task"
        holder.mkdir(mode=0o700)
        link = holder / name
        os.symlink(f"/proc/self/fd/{fd}", link)
        t = OpenTask(raw, fd, link, None, ())  # type: ignore[arg-type]
        if not os.path.lexists(link / "task.json"):
            raise TaskRefused(404, f"{raw} is not a task directory (it has no task.json); a task set's tasks are "
                                   "its subdirectories (docs/tasks.md)")
        try:
            t.task, _ = load_task(holder, name)
        except TaskFormatError as e:
            raise TaskRefused(400, t.hide(str(e))) from None
        t.fingerprint = fingerprint(fd)
        yield t
    finally:
        shutil.rmtree(holder, ignore_errors=True)
        os.close(fd)


@dataclass
class Cached:
    """One task's snapshot in the cache; `ready` resolves when its copy is complete."""

    key: str
    fingerprint: tuple
    ready: Future = field(default_factory=Future)
    path: Path | None = None
    bytes: int = 0
    refs: int = 0
    retired: bool = False  # out of the cache (replaced or evicted): removed when its last user releases it


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (links not followed)."""
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(top, name))
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


class TaskSnapshots:
    """The cache of task snapshots (see the module docstring). Thread-safe; copies run on the caller's thread."""

    def __init__(self, h: Host, bounds: CopyBounds, max_count: int, max_bytes: int):
        self.h, self.max_count, self.max_bytes = h, max_count, max_bytes
        # A task's environment (`.venv/bin/python`) links to the interpreter outside the tree; inside a sandbox such
        # a link resolves in the sandbox's own filesystem, so it is kept as a link (docs/sandbox.md).
        self.bounds = replace(bounds, keep_outward_links=True)
        self.entries: OrderedDict[str, Cached] = OrderedDict()  # least recently used first
        self.retired: list[Cached] = []
        self.lock = threading.Lock()
        self.made = self.hits = self.evicted = self.replaced = 0
        self.links = Path(tempfile.mkdtemp(prefix="shipyard-task-links-"))
        self.closed = False

    def acquire(self, t: OpenTask) -> Cached:
        """The snapshot of `t`'s `snapshot/`, copied now if the cache has no current one; release it when done."""
        while True:
            with self.lock:
                if self.closed:
                    raise TaskRefused(503, "the server is shutting down")
                entry = self.entries.get(t.key)
                if entry is not None and entry.fingerprint == t.fingerprint:
                    if entry.ready.done():
                        entry.refs += 1
                        self.entries.move_to_end(t.key)
                        self.hits += 1
                        return entry
                    pending, mine = entry.ready, None
                else:
                    if entry is not None:  # the task changed on disk since it was copied
                        self.replaced += 1
                        self._retire(entry)
                    mine = self.entries[t.key] = Cached(t.key, t.fingerprint, refs=1)
            if mine is None:
                pending.exception()  # wait for the first request's copy; then look again (it may have failed)
                continue
            return self._copy(t, mine)

    def _copy(self, t: OpenTask, entry: Cached) -> Cached:
        try:
            root = Path(f"/proc/self/fd/{t.fd}")
            path = make_snapshot(root / "snapshot", self.h, f"task-{uuid.uuid4().hex[:12]}", bounds=self.bounds,
                                 within=(root,))
        except BaseException as e:
            with self.lock:
                if self.entries.get(t.key) is entry:
                    del self.entries[t.key]
            entry.ready.set_exception(e)
            if isinstance(e, SnapshotRefused):
                raise TaskRefused(422, t.hide(str(e))) from None
            if isinstance(e, OSError):
                raise TaskRefused(422, t.hide(f"cannot snapshot the task's snapshot/: {e.strerror or e}")) from None
            raise
        size = tree_bytes(path)
        with self.lock:
            entry.path, entry.bytes = path, size
            self.made += 1
            doomed = self._evict()
            if self.closed:
                doomed.append(path)
        for p in doomed:
            remove_snapshot(p)
        entry.ready.set_result(path)
        return entry

    def _retire(self, entry: Cached) -> None:
        """Under the lock: take `entry` out of the cache; removed now if unused (by the caller), else on release."""
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
        entry.retired = True
        self.retired.append(entry)

    def _evict(self) -> list[Path]:
        """Under the lock: retire least recently used, unused entries until the cache is within its bounds; the
        paths to remove (after the lock is released)."""
        size = sum(e.bytes for e in self.entries.values())
        for entry in list(self.entries.values()):
            if len(self.entries) <= self.max_count and size <= self.max_bytes:
                break
            if entry.refs == 0 and entry.path is not None:
                self._retire(entry)
                self.evicted += 1
                size -= entry.bytes
        return self._collect()

    def _collect(self) -> list[Path]:
        gone = [e for e in self.retired if e.refs == 0]
        self.retired = [e for e in self.retired if e.refs > 0]
        return [e.path for e in gone if e.path is not None]

    def release(self, entry: Cached) -> None:
        with self.lock:
            entry.refs -= 1
            doomed = self._evict() if not self.closed else []
        for p in doomed:
            remove_snapshot(p)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"cached": len(self.entries), "bytes": sum(e.bytes for e in self.entries.values()),
                    "in_use": sum(e.refs for e in [*self.entries.values(), *self.retired]), "made": self.made,
                    "hits": self.hits, "evicted": self.evicted, "replaced": self.replaced}

    def close(self) -> None:
        """Remove every snapshot, in use or not (the server is shutting down: its sandboxes are gone)."""
        with self.lock:
            self.closed = True
            paths = [e.path for e in [*self.entries.values(), *self.retired] if e.path is not None]
            self.entries.clear()
            self.retired = []
        for p in paths:
            remove_snapshot(p)
        shutil.rmtree(self.links, ignore_errors=True)
