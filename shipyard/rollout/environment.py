"""Where episodes run and are graded: the `Environment` seam, and `LocalEnvironment` (in-process sandboxes).

An episode needs two things of its environment: a fresh workspace over the task's repository, and a verdict on the
patch it wrote. Both start from the task's `snapshot/`, and copying that tree is the expensive part (a task with its
prepared environment is hundreds of MB); a sandbox over a ready snapshot costs only an empty overlay upper dir
(~20 ms). So an environment makes one sandbox snapshot per task, the first time the task is asked for, and every
episode of the task and every grading of its patches starts from that one (the grader takes it as `snapshot=`);
`close()` removes them. A group of N rollouts of one task costs one copy, not 2N.

Two implementations, one protocol: `LocalEnvironment` (bubblewrap sandboxes in this process, the default) and
`shipyard.rollout.remote.RemoteEnvironment` (the environment server's sandboxes and its `/grade`, for rollout
workers on machines that cannot run them).

**Faults are data.** Every infrastructure failure surfaces as `InfraError`, which the agent loop and `run_episode`
turn into a rollout with status `infra_error` (reward None, trajectory kept), never into an exception that loses the
rollout or a zero that trains the model. A local sandbox's exec session that dies is restarted by `Sandbox` over the
same files, and the call in flight fails with `SessionRestarted` — the model's doing (a memory limit, a `kill`), told
to the model like any OSError. Only when no new session starts, or the sandbox was closed under the episode, is the
sandbox gone: `Sandbox` raises `SandboxFailed`, an `InfraError`.

Thread-safe: many episode threads share one environment; the snapshot of a task is made once even when its first
episodes arrive together (a lock per task, so copying one task's tree does not hold up another's episodes).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from shipyard.harness.workspace import Workspace
from shipyard.rollout.record import EpisodeSpec
from shipyard.sandbox.bwrap import Limits
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox, SandboxFailed
from shipyard.sandbox.snapshot import snapshot_of
from shipyard.tasks.grade import Verdict, grade
from shipyard.tasks.taskset import load_task


class Environment(Protocol):
    name: str

    def workspace(self, spec: EpisodeSpec) -> AbstractContextManager[Workspace]:
        """A fresh sandbox over the task's snapshot (task_dir/snapshot), closed on exit. Infra failures raise
        InfraError."""
        ...

    def grade(self, spec: EpisodeSpec, patch: str, timeout: float) -> Verdict:
        """Grade `patch` in a fresh sandbox from the snapshot cached for the task (no copy per call). Raises
        TaskFormatError for a malformed task; an infrastructure failure is a verdict with status infra_error."""
        ...

    def close(self) -> None: ...


@dataclass
class _TaskSnapshot:
    lock: threading.Lock = field(default_factory=threading.Lock)
    stack: ExitStack = field(default_factory=ExitStack)  # owns the snapshot (`snapshot_of`); closed by close()
    path: Path | None = None


class LocalEnvironment:
    """Bubblewrap sandboxes in this process; one snapshot per task, made on first use, reused, removed on close."""

    def __init__(self, limits: Limits | None = None, name: str = "local"):
        self.name = name
        self.limits = limits or Limits()
        self.snapshots_made = 0  # copies of a task's tree so far (one per task: the point of the cache)
        self._tasks: dict[Path, _TaskSnapshot] = {}
        self._lock = threading.Lock()
        self._closed = False

    def snapshot(self, task_dir: Path) -> Path:
        """The sandbox snapshot of `task_dir/snapshot`, made the first time it is asked for."""
        key = Path(task_dir).resolve()
        with self._lock:
            if self._closed:
                raise SandboxFailed(f"the environment {self.name} is closed")
            entry = self._tasks.setdefault(key, _TaskSnapshot())
        with entry.lock:
            if entry.path is None:
                try:
                    entry.path = entry.stack.enter_context(snapshot_of(key / "snapshot", host()))
                except (OSError, RuntimeError) as e:  # load_task checked the tree: this is the host (disk, limits)
                    raise SandboxFailed(f"no snapshot of {key / 'snapshot'}: {type(e).__name__}: {e}") from e
                with self._lock:
                    self.snapshots_made += 1
            return entry.path

    @contextlib.contextmanager
    def workspace(self, spec: EpisodeSpec) -> Iterator[Workspace]:
        snapshot = self.snapshot(spec.task_dir)
        try:
            sandbox = Sandbox(snapshot, self.limits)
        except SandboxFailed:
            raise
        except (OSError, RuntimeError) as e:  # cgroups, the layout, the launcher: not the model's doing
            raise SandboxFailed(f"no sandbox over {snapshot}: {type(e).__name__}: {e}") from e
        try:
            yield sandbox
        finally:
            with contextlib.suppress(OSError, RuntimeError):  # what teardown leaves, the next start recovers
                sandbox.close()

    def grade(self, spec: EpisodeSpec, patch: str, timeout: float) -> Verdict:
        task, task_dir = load_task(spec.tasks_dir, spec.task_id)
        try:
            snapshot = self.snapshot(task_dir)
        except SandboxFailed as e:
            return Verdict(task.id, "graded", 0.0).conclude("infra_error", f"no grading snapshot: {e}", reward=None)
        return grade(task, task_dir, patch, timeout=timeout, snapshot=snapshot)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries, self._tasks = list(self._tasks.values()), {}
        for entry in entries:
            with entry.lock:  # after a copy in progress: it is removed, not leaked
                entry.stack.close()
                entry.path = None

    def __enter__(self) -> LocalEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
