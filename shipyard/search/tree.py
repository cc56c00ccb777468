"""The files an index reads: a repository on this machine (`LocalTree`), or anything else that can list its files with
a cheap change stamp and read one (`FileSource`: a sandbox's workspace, a task snapshot).

Which files: those ripgrep would search (`rg --files`: .gitignore and .ignore files obeyed, with or without a .git
directory; hidden files and directories left out; symbolic links not followed), without the directories the
workspace's tools ignore (.venv, node_modules, caches), each at most `max_bytes`, not binary (a NUL byte in its first
8 KiB, as git decides) and named in UTF-8 without control characters. A repository an index is built from may be
hostile (tasks are synthesized from arbitrary repositories): a path is only ever opened below the root, without
following links.
"""

from __future__ import annotations

import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shipyard.harness.confined import IGNORED_DIRS
from shipyard.harness.tools.base import installed_binary

MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class Stamp:
    """What says a file may have changed without reading it (as git's index does): its size and modification time."""

    size: int
    mtime_ns: int


class FileSource(Protocol):
    def files(self) -> dict[str, Stamp]:
        """The indexable files ('/'-separated paths relative to the root) and their stamps."""
        ...

    def read(self, path: str) -> bytes | None:
        """A file's bytes; None when it is gone, too large or binary."""
        ...


class LocalTree:
    """A directory on this machine as a `FileSource` (see the module docstring)."""

    def __init__(self, root: Path, *, max_bytes: int = MAX_FILE_BYTES):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise NotADirectoryError(f"{root} is not a directory")
        self.max_bytes = max_bytes

    def files(self) -> dict[str, Stamp]:
        skip = [arg for name in sorted(IGNORED_DIRS) for arg in ("--glob", f"!{name}")]  # as the workspace's tools
        proc = subprocess.run([installed_binary("rg"), "--files", "--no-require-git", "--no-config", "--null", *skip],
                              cwd=self.root, capture_output=True, timeout=300)
        if proc.returncode not in (0, 1):  # 1: no files
            raise OSError(f"listing {self.root} failed: {proc.stderr.decode(errors='replace')[-500:]}")
        out = {}
        for raw in proc.stdout.split(b"\0"):
            if not raw:
                continue
            path = raw.decode("utf-8", "surrogateescape").removeprefix("./")
            if not indexable_name(path):
                continue
            try:
                st = os.lstat(self.root / path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size <= self.max_bytes:
                out[path] = Stamp(st.st_size, st.st_mtime_ns)
        return out

    def read(self, path: str) -> bytes | None:
        parts = path.split("/")
        if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{path!r} is not a relative path inside the tree")
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:  # walk down without following a link at any step: a swapped-in link cannot lead outside the root
                for part in parts[:-1]:
                    inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    os.close(fd)
                    fd = inner
                leaf = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
            finally:
                os.close(fd)
        except OSError:
            return None
        with os.fdopen(leaf, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            data = f.read(self.max_bytes + 1)
        return indexable_data(data, self.max_bytes)


def indexable_name(path: str) -> bool:
    """A name the index can hold and show: valid UTF-8 (no lone surrogate from undecodable bytes) and no control
    character (a newline in a name would let it forge lines of the tool's output)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(ord(ch) < 32 or ord(ch) == 127 for ch in path)


def indexable_data(data: bytes, max_bytes: int = MAX_FILE_BYTES) -> bytes | None:
    """`data`, unless the index leaves it out: over `max_bytes`, or binary (a NUL byte in its first 8 KiB)."""
    return None if len(data) > max_bytes or b"\0" in data[:8192] else data
