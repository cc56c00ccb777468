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
  message tells the model what to do instead.
* **A baseline for `diff()`.** The workspace remembers the tree as it was when opened, so the agent's whole
  effect — edits by tools and by shell commands alike — is reported as one `git diff`-format patch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal, Protocol

from shipyard.harness.process import ExecResult, Job, local_job, run_process, spawn_process

# Directories that are never part of a baseline, a diff or a glob: VCS metadata, caches, virtual environments.
IGNORED_DIRS = frozenset({".git", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache",
                          ".ruff_cache", ".hypothesis", ".tox"})

Kind = Literal["file", "dir", "missing", "other"]

# The most bytes of one file that crosses from a workspace to the host: `read_bytes` refuses larger files and
# `diff()` reports them by name and size instead of copying them into the patch (host memory stays bounded
# whatever a sandbox writes; see docs/security.md).
MAX_FILE_BYTES = 16 << 20


class PathError(ValueError):
    """A path a model asked for is outside the workspace or otherwise unusable; the message is for the model."""


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
            shutil.copytree(self.root, self._baseline, symlinks=True, ignore=shutil.ignore_patterns(*IGNORED_DIRS))
        else:
            self._baseline = Path(baseline)
        self._jobs: list[Job] = []
        self._lock = threading.Lock()

    # Paths ------------------------------------------------------------------------------------------------
    def resolve(self, path: str) -> str:
        if not isinstance(path, str) or not path.strip():
            raise PathError("path must be a non-empty string (relative to the workspace root, e.g. 'src/app.py')")
        if "\x00" in path:
            raise PathError("path contains a NUL byte")
        p = PurePosixPath(path.strip())
        candidate = Path(p) if p.is_absolute() else self.root / p
        # Resolve symlinks on the longest existing prefix; a missing tail cannot be a link, so it is kept as is.
        real = candidate.resolve(strict=False)
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
    def kind(self, path: str) -> Kind:
        real = self._real(path)
        if real.is_dir():
            return "dir"
        if real.is_file():
            return "file"
        return "other" if real.exists() or real.is_symlink() else "missing"

    def read_bytes(self, path: str) -> bytes:
        return self._real(path).read_bytes()

    def write_bytes(self, path: str, data: bytes) -> None:
        real = self._real(path)
        real.parent.mkdir(parents=True, exist_ok=True)
        real.write_bytes(data)

    def delete(self, path: str) -> None:
        self._real(path).unlink()

    def listdir(self, path: str) -> list[Entry]:
        out = []
        for e in sorted(self._real(path).iterdir(), key=lambda p: (not p.is_dir(), p.name)):
            if e.is_symlink():
                out.append(Entry(e.name, "link", 0, os.readlink(e)))
            elif e.is_dir():
                out.append(Entry(e.name, "dir", 0))
            elif e.is_file():
                out.append(Entry(e.name, "file", e.stat().st_size))
            else:
                out.append(Entry(e.name, "other", 0))
        return out

    def glob(self, pattern: str, path: str) -> list[str]:
        base = self._real(path)
        matches = []
        for match in base.glob(pattern):
            if any(part in IGNORED_DIRS for part in match.relative_to(base).parts):
                continue
            real = match.resolve()
            if real != self.root and self.root not in real.parents:
                continue  # reached through a symlink that leaves the workspace
            matches.append(match.absolute().relative_to(self.root).as_posix())
        return sorted(matches)

    def files(self, limit: int) -> list[str]:
        paths: list[str] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_DIRS and not d.startswith("."))
            rel = Path(dirpath).relative_to(self.root)
            paths += [(rel / f).as_posix() for f in sorted(filenames) if not f.startswith(".")]
            if len(paths) > limit:
                break
        return paths[: limit + 1]

    # Processes --------------------------------------------------------------------------------------------
    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def run(self, argv: list[str], *, timeout: float, cwd: str | None = None, env: dict[str, str] | None = None,
            stdin: bytes | None = None) -> ExecResult:
        return run_process(argv, timeout=timeout, cwd=cwd or self.exec_root, env=env, stdin=stdin)

    def spawn(self, command: list[str], *, cwd: str, env: dict[str, str]) -> Job:
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


DIFF_HEADER = re.compile(r"^diff --git ([ab])/(.+) \1/\2$", re.MULTILINE)


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
    # Added and deleted files name one side twice (`b/x b/x`); write the conventional `a/x b/x`.
    return DIFF_HEADER.sub(r"diff --git a/\2 b/\2", proc.stdout.decode(errors="replace"))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
