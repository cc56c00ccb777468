"""Where tools act: the `Workspace` seam, and `LocalWorkspace`, a plain directory on this machine.

Tools never touch the filesystem or start processes themselves; they go through a workspace, so the same
tool code runs against a local checkout (the plain CLI agent) and against a sandbox session (RL rollouts,
`shipyard agent --sandbox`). A workspace owns two guarantees the tools rely on:

* **Confinement.** Every path a model names is resolved with `resolve()`: relative paths are taken from the
  workspace root, absolute paths are accepted only when they already lie inside it, and the final location
  (after following symlinks, including the parent of a file that does not exist yet) must stay inside the
  root. `..` tricks, absolute paths elsewhere and symlinks pointing out are refused with a `PathError` whose
  message tells the model what to do instead.
* **A baseline for `diff()`.** The workspace remembers the tree as it was when opened, so the agent's whole
  effect — edits by tools and by shell commands alike — is reported as one `git diff`-format patch.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

# Directories that are never part of a baseline or a diff: VCS metadata, caches and virtual environments.
IGNORED_DIRS = frozenset({".git", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache",
                          ".ruff_cache", ".hypothesis", ".tox"})


class PathError(ValueError):
    """A path a model asked for is outside the workspace or otherwise unusable; the message is for the model."""


@dataclass
class ExecResult:
    """A finished (or killed) process: combined output, exit code and whether it ran past its timeout.

    `output` holds at most the first and the last `max_output` bytes; `dropped_bytes` counts what was between.
    """

    output: bytes
    exit_code: int
    timed_out: bool
    seconds: float
    dropped_bytes: int = 0


class BoundedCapture:
    """Reads a pipe to its end on a thread, keeping only the first and last `keep` bytes (memory-bounded).

    A command that prints without end (`yes`) costs a counter, not memory or disk.
    """

    def __init__(self, fd: int, keep: int):
        self.fd, self.keep = fd, keep
        self.head, self.tail = bytearray(), bytearray()
        self.total = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self.fd], [], [], 0.05)
            if not ready:
                if self.stop.is_set():
                    return  # something outside the killed group still holds the pipe open; stop listening
                continue
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return
            self.total += len(chunk)
            room = self.keep - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                self.tail += chunk
                del self.tail[: max(0, len(self.tail) - self.keep)]

    def finish(self, grace: float = 1.0) -> tuple[bytes, int]:
        self.thread.join(timeout=grace)
        self.stop.set()
        self.thread.join()
        os.close(self.fd)
        return bytes(self.head + self.tail), self.total - len(self.head) - len(self.tail)


class Workspace(Protocol):
    """The filesystem and process view that tools act on. Paths are workspace-relative POSIX strings."""

    @property
    def root(self) -> Path: ...

    def resolve(self, path: str) -> Path:
        """Map a model-supplied path to a real location inside the workspace, or raise `PathError`."""
        ...

    def relative(self, real: Path) -> str:
        """The workspace-relative POSIX form of a resolved path, for messages to the model."""
        ...

    def run(self, argv: list[str], *, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None,
            stdin: bytes | None = None) -> ExecResult:
        """Run a process to completion (or kill its whole process group at `timeout`)."""
        ...

    def spawn(self, argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start a background process in its own process group, its output appended to `log`."""
        ...

    def diff(self) -> str:
        """Everything changed since the workspace was opened, as a `git diff` patch relative to the root."""
        ...

    def close(self) -> None: ...


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a process's whole group (it was started with `start_new_session=True`)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_process(argv: list[str], *, timeout: float, cwd: Path, env: dict[str, str] | None,
                stdin: bytes | None = None, max_output: int = 1 << 20) -> ExecResult:
    """Run `argv` with stdout+stderr merged; on timeout kill the process group and keep the partial output."""
    start = time.monotonic()
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=write_fd, stderr=write_fd,
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                start_new_session=True)
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    capture = BoundedCapture(read_fd, max_output)
    timed_out = False
    try:
        proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        proc.wait()
    # Children left running in the group (e.g. `sleep 100 &` without a background request) die with it.
    kill_group(proc)
    output, dropped = capture.finish()
    return ExecResult(output, proc.returncode, timed_out, time.monotonic() - start, dropped)


class LocalWorkspace:
    """A directory on this machine. The baseline for `diff()` is a copy taken when the workspace is opened."""

    def __init__(self, root: str | Path):
        root = Path(root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"workspace root {root} is not a directory")
        self._root = root.resolve()
        self._baseline_dir: Path | None = Path(tempfile.mkdtemp(prefix="shipyard-base-")) / "a"
        shutil.copytree(self._root, self._baseline_dir, symlinks=True, ignore=shutil.ignore_patterns(*IGNORED_DIRS))

    @property
    def root(self) -> Path:
        return self._root

    def resolve(self, path: str) -> Path:
        if not isinstance(path, str) or not path.strip():
            raise PathError("path must be a non-empty string (relative to the workspace root, e.g. 'src/app.py')")
        if "\x00" in path:
            raise PathError("path contains a NUL byte")
        p = PurePosixPath(path.strip())
        candidate = Path(p) if p.is_absolute() else self._root / p
        # Resolve symlinks on the longest existing prefix; a missing tail cannot be a link, so it is kept as is.
        real = candidate.resolve(strict=False)
        if real != self._root and self._root not in real.parents:
            hint = "absolute paths must lie inside the workspace" if p.is_absolute() else "'..' may not leave it"
            via = " (through a symbolic link)" if self._lexically_inside(candidate) else ""
            raise PathError(f"path '{path}' is outside the workspace{via}; {hint}. Use paths relative to the "
                            f"workspace root, e.g. 'src/app.py'.")
        return real

    def _lexically_inside(self, candidate: Path) -> bool:
        normal = Path(os.path.normpath(candidate))
        return normal == self._root or self._root in normal.parents

    def relative(self, real: Path) -> str:
        rel = real.relative_to(self._root).as_posix()
        return rel if rel else "."

    def run(self, argv: list[str], *, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None,
            stdin: bytes | None = None) -> ExecResult:
        return run_process(argv, timeout=timeout, cwd=cwd or self._root, env=env, stdin=stdin)

    def spawn(self, argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
        with open(log, "ab") as fh:
            return subprocess.Popen(argv, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def diff(self) -> str:
        if self._baseline_dir is None:
            raise RuntimeError("the workspace is closed")
        return tree_diff(self._baseline_dir, self._root)

    def close(self) -> None:
        if self._baseline_dir is not None:
            shutil.rmtree(self._baseline_dir.parent, ignore_errors=True)
            self._baseline_dir = None


def tree_diff(before: Path, after: Path) -> str:
    """`git diff` of two directory trees with paths relative to each root (`a/x.py`, `b/x.py`).

    `git diff --no-index` has no pathspec excludes, so both trees are mirrored (hard links, no copying) into
    a scratch dir as `a/` and `b/` without the ignored directories; with `--no-prefix` the paths git prints are
    then exactly the conventional `a/x.py` and `b/x.py`.
    """
    with tempfile.TemporaryDirectory(prefix="shipyard-diff-") as tmp:
        for name, src in (("a", before), ("b", after)):
            shutil.copytree(src, Path(tmp) / name, symlinks=True, copy_function=_link_or_copy,
                            ignore=shutil.ignore_patterns(*IGNORED_DIRS))
        proc = subprocess.run(["git", "-c", "core.quotepath=off", "diff", "--no-index", "--binary", "--no-color",
                               "--no-ext-diff", "--no-prefix", "a", "b"], cwd=tmp, capture_output=True)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"git diff failed: {proc.stderr.decode(errors='replace')}")
    return proc.stdout.decode(errors="replace")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
