"""Where tools act: the `Workspace` seam, and `LocalWorkspace`, a plain directory on this machine.

Tools never touch the filesystem or start processes themselves; they go through a workspace, with paths
relative to its root, so the same tool code runs against a local checkout (the plain CLI agent) and against a
sandbox, whose merged copy-on-write view exists only inside the sandbox (RL rollouts, `shipyard agent
--sandbox`): there the very same operations are served by a `LocalWorkspace` running inside the sandbox. A
workspace owns two guarantees the tools rely on:

* **Confinement.** Every path a model names is resolved with `resolve()`: relative paths are taken from the
  workspace root, absolute paths are accepted only when they already lie inside it, and the final location
  (after following symlinks, including the parent of a file that does not exist yet) must stay inside the
  root. `..` tricks, absolute paths elsewhere and symlinks pointing out are refused with a `PathError` whose
  message tells the model what to do instead. The file operations then walk the checked path again without
  following any link and open regular files only, at most `MAX_FILE_BYTES` of them (`shipyard.harness.confined`:
  the model's own processes may swap a path for a link or a FIFO after the check); walks of the tree (`glob`,
  `files`) never enter links and `glob`'s is bounded. Whatever a model sends, a method raises `PathError` or
  `OSError` (the sandbox's session carries exactly those two back), never another exception, and never hangs.
* **A baseline for `diff()`.** The workspace remembers the tree as it was when opened, so the agent's whole
  effect — edits by tools and by shell commands alike — is reported as one `git diff`-format patch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal, Protocol

from shipyard.harness.confined import (
    IGNORED_DIRS,
    MAX_FILE_BYTES,
    Budget,
    PathError,
    Pattern,
    Tree,
    check_text,
    error_for,
    show,
)
from shipyard.harness.diff import tree_diff
from shipyard.harness.process import ExecResult, Job, local_job, run_process, spawn_process

Kind = Literal["file", "dir", "missing", "other"]

# Bounds on walking the tree for a model (`glob`; listing one directory): entries looked at, and seconds.
MAX_GLOB_ENTRIES = 100_000
GLOB_SECONDS = 10.0
MAX_DIR_ENTRIES = 10_000


@dataclass
class Entry:
    name: str
    kind: Literal["file", "dir", "link", "other"]
    size: int
    target: str | None = None  # where a symlink points


class Workspace(Protocol):
    """The filesystem and process view that tools act on.

    File methods take the canonical workspace-relative paths that `resolve` returns ("." is the root).
    Processes run in the workspace's execution environment, where the root is `exec_root`.
    """

    exec_root: str

    def resolve(self, path: str) -> str:
        """Check a model-supplied path and return its canonical workspace-relative form, or raise `PathError`."""
        ...

    def kind(self, path: str) -> Kind: ...

    def read_bytes(self, path: str) -> bytes: ...

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a file, creating its parent directories."""
        ...

    def delete(self, path: str) -> None: ...

    def listdir(self, path: str) -> list[Entry]: ...

    def glob(self, pattern: str, path: str) -> list[str]:
        """Workspace-relative paths under `path` matching `pattern`, without ignored directories."""
        ...

    def files(self, limit: int) -> list[str]:
        """Up to `limit` file paths, breadth of the tree first (for an overview of the workspace)."""
        ...

    def environment(self) -> dict[str, str]:
        """The environment processes start from in the execution environment (the shell session's base)."""
        ...

    def run(self, argv: list[str], *, timeout: float, cwd: str | None = None, env: dict[str, str] | None = None,
            stdin: bytes | None = None) -> ExecResult:
        """Run a process to completion (or kill its whole process group at `timeout`); `cwd` defaults to the root."""
        ...

    def spawn(self, command: list[str], *, cwd: str, env: dict[str, str]) -> Job:
        """Start a background process (its own process group) logging to a file the shell can read."""
        ...

    def diff(self) -> str:
        """Everything changed since the workspace was opened, as a `git diff` patch relative to the root."""
        ...

    def close(self) -> None:
        """Stop background processes and release what the workspace holds."""
        ...


class LocalWorkspace:
    """A directory on this machine.

    The baseline for `diff()` is `baseline` when given (a sandbox passes its read-only snapshot), else a copy
    taken when the workspace is opened.
    """

    def __init__(self, root: str | Path, baseline: str | Path | None = None):
        root = Path(root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"workspace root {root} is not a directory")
        self.root = root.resolve()
        self.exec_root = str(self.root)
        self._scratch = Path(tempfile.mkdtemp(prefix="shipyard-ws-"))
        if baseline is None:
            self._baseline = self._scratch / "baseline"
            shutil.copytree(self.root, self._baseline, symlinks=True, ignore=_baseline_ignores)
        else:
            self._baseline = Path(baseline)
        self._jobs: list[Job] = []
        self._lock = threading.Lock()
        self._tree = Tree(self.root)

    # Paths ------------------------------------------------------------------------------------------------
    def resolve(self, path: str) -> str:
        if not isinstance(path, str) or not path.strip():
            raise PathError("path must be a non-empty string (relative to the workspace root, e.g. 'src/app.py')")
        check_text(path.strip())
        p = PurePosixPath(path.strip())
        candidate = Path(p) if p.is_absolute() else self.root / p
        # Resolve symlinks on the longest existing prefix; a missing tail cannot be a link, so it is kept as is.
        try:
            real = candidate.resolve(strict=False)
        except (RuntimeError, OSError) as e:  # a symlink loop (RuntimeError before Python 3.13, then OSError)
            raise PathError(f"path {show(path)} runs into a loop of symbolic links; use a path without them "
                            "(`ls -l` in run_terminal shows where links point).") from e
        if real != self.root and self.root not in real.parents:
            hint = "absolute paths must lie inside the workspace" if p.is_absolute() else "'..' may not leave it"
            normal = Path(os.path.normpath(candidate))
            via = " (through a symbolic link)" if normal == self.root or self.root in normal.parents else ""
            raise PathError(f"path '{path}' is outside the workspace{via}; {hint}. Use paths relative to the "
                            f"workspace root, e.g. 'src/app.py'.")
        return real.relative_to(self.root).as_posix() or "."

    def _real(self, path: str) -> Path:
        return self.root / path

    # Files ------------------------------------------------------------------------------------------------
    # File operations walk the path again without following links and open regular files only (see
    # shipyard.harness.confined): a path checked by `resolve` may have been swapped since by the model's processes.
    def kind(self, path: str) -> Kind:
        try:
            mode = os.stat(self._real(path)).st_mode
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return "other" if os.path.lexists(self._real(path)) else "missing"
            raise error_for(path, e) from None
        return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"

    def read_bytes(self, path: str) -> bytes:
        """The file's bytes; a `PathError` for anything but a regular file of at most `MAX_FILE_BYTES`."""
        return self._tree.read(path, MAX_FILE_BYTES)

    def write_bytes(self, path: str, data: bytes) -> None:
        self._tree.write(path, data)

    def delete(self, path: str) -> None:
        self._tree.delete(path)

    def listdir(self, path: str) -> list[Entry]:
        """Entries, directories first; at most `MAX_DIR_ENTRIES` + 1 of them (more means the directory has more)."""
        return [Entry(*e) for e in self._tree.listdir(path, MAX_DIR_ENTRIES + 1)]

    def glob(self, pattern: str, path: str) -> list[str]:
        if not isinstance(pattern, str) or not pattern.strip():
            raise PathError("the pattern is empty; e.g. '**/*.py' or 'tests/test_*.py'.")
        check_text(pattern, "pattern")
        compiled = Pattern(pattern)
        matches = [path] if compiled.matches(compiled.start) else []
        walk = self._tree.walk(path, compiled.start, compiled.step, compiled.descend, skip=IGNORED_DIRS,
                               max_entries=MAX_GLOB_ENTRIES, seconds=GLOB_SECONDS)
        try:
            for rel, is_dir, is_link, states in walk:
                if not compiled.matches(states):
                    continue
                if is_link:  # reported only if it points inside (it is never entered)
                    try:
                        real = (self.root / rel).resolve()
                    except (RuntimeError, OSError):
                        continue
                    if real != self.root and self.root not in real.parents:
                        continue
                    is_dir = real.is_dir()
                if is_dir or not compiled.dir_only:
                    matches.append(rel)
        except Budget as e:
            raise PathError(f"glob stopped after looking at {e} under {show(path)} ({len(matches)} matches so far); "
                            "narrow `path` or start the pattern with fixed directories (e.g. 'src/**/*.py'), or "
                            "use run_terminal (`find … | head`).") from None
        return sorted(matches)

    def files(self, limit: int) -> list[str]:
        """Breadth first: a directory's files before its subdirectories' (hidden and ignored names left out)."""
        paths: list[str] = []
        for rel, is_dir, _, _ in self._tree.walk(".", True, _visible, bool, skip=IGNORED_DIRS):
            if not is_dir:
                paths.append(rel)
                if len(paths) > limit:
                    break
        return paths

    # Processes --------------------------------------------------------------------------------------------
    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def run(self, argv: list[str], *, timeout: float, cwd: str | None = None, env: dict[str, str] | None = None,
            stdin: bytes | None = None) -> ExecResult:
        _check_exec(argv, cwd, env)
        return run_process(argv, timeout=timeout, cwd=cwd or self.exec_root, env=env, stdin=stdin)

    def spawn(self, command: list[str], *, cwd: str, env: dict[str, str]) -> Job:
        _check_exec(command, cwd, env)
        with self._lock:
            job_id = len(self._jobs) + 1
            log = self._scratch / f"job{job_id}.log"
            proc = spawn_process(command, cwd=cwd, env=env, log=log)
            job = local_job(job_id, " ".join(command), proc, str(log))
            self._jobs.append(job)
        return job

    # Whole workspace --------------------------------------------------------------------------------------
    def diff(self) -> str:
        return tree_diff(self._baseline, self.root)

    def close(self) -> None:
        with self._lock:
            for job in self._jobs:
                job.stop()
            self._jobs.clear()
        shutil.rmtree(self._scratch, ignore_errors=True)


def _baseline_ignores(directory: str, names: list[str]) -> set[str]:
    """What the baseline copy skips: ignored directories, and special files (opening a FIFO would block forever;
    `tree_diff` names them instead)."""
    skip = set(names) & IGNORED_DIRS
    for name in names:
        with contextlib.suppress(OSError):
            mode = os.lstat(os.path.join(directory, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                skip.add(name)
    return skip


def _visible(_: bool, name: str, is_dir: bool) -> bool | None:
    return None if name.startswith(".") else True


def _check_exec(argv: list[str], cwd: str | None, env: dict[str, str] | None) -> None:
    """What `exec` cannot take (a NUL byte, a lone surrogate, `=` in a variable's name) as an OSError, before a
    ValueError from deep inside subprocess could end the episode."""
    strings = [*argv, cwd or "", *(env or {}), *(env or {}).values()]
    for s in strings:
        if "\x00" in s:
            raise OSError(errno.EINVAL, f"an argument holds a NUL byte, which no process argument can: {show(s)}")
        try:
            os.fsencode(s)
        except UnicodeEncodeError:
            raise OSError(errno.EINVAL, f"an argument holds a lone surrogate, which no process argument can: "
                                        f"{show(s)}") from None
    if any("=" in key or not key for key in env or {}):
        raise OSError(errno.EINVAL, "an environment variable name is empty or holds '='")
