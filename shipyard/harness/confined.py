"""Filesystem operations confined to one directory tree, safe against what a model does to that tree meanwhile.

`LocalWorkspace.resolve` checks a model's path once. Between that check and its use, a process the model started
(a background job, a parallel `run_terminal`) can replace a directory on the way with a symbolic link that leaves
the workspace, or the file with a FIFO whose `open` never returns. So each operation here walks the checked path
again from the root, one component at a time (`openat` with `O_NOFOLLOW`), and opens only regular files: `lstat`
first (a FIFO is never opened), then `open(O_NONBLOCK | O_NOFOLLOW)`, then `fstat` of what was actually opened. A
link met on the way or a special file is refused with a `PathError` for the model; nothing is followed.

Reads are bounded: the size is checked before reading, and the read stops past the limit should the file grow.
Walks of the tree (`glob`, `overview`) are iterative, never enter a directory through a link (each directory is
opened with `O_NOFOLLOW` and must be the very inode its parent listed), and `glob` stops at an entry budget and a
time budget. Its pattern is matched one name at a time by a small automaton whose states are the pattern's
segments, with repeated `**` collapsed — so neither a deep tree, a link cycle nor `**/**/**/**/*.py` can make it
recurse, loop or take exponential time.

Only the standard library is imported: this module also runs inside sandboxes (`shipyard.sandbox.session`).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

# Linux's PATH_MAX and NAME_MAX in bytes: longer paths can never be opened.
# Directories that are never part of a baseline, a diff or a glob: VCS metadata, caches, virtual environments.
IGNORED_DIRS = frozenset({".git", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache",
                          ".ruff_cache", ".hypothesis", ".tox"})
# What a project's own test run writes into the tree it runs in: coverage.py's data (`.coverage`, and
# `.coverage.<host>.<pid>.<random>` in parallel mode) and reports (`coverage.xml`, `htmlcov/`), made whenever pytest-cov
# is in the project's addopts. Never part of an agent's change, so an episode's patch leaves them out (unless the
# baseline has them: then they are the project's own files) as it leaves out `.pytest_cache`: the grader refuses
# hidden and binary files, so one `pytest` would otherwise zero the episode.
TEST_OUTPUTS = re.compile(r"\.coverage(\..*)?|coverage\.xml|htmlcov", re.DOTALL)


def is_test_output(name: str) -> bool:
    """Whether a tree entry named `name` is written by test runs (`TEST_OUTPUTS`), not by the agent."""
    return TEST_OUTPUTS.fullmatch(name) is not None

# The most bytes of one file that crosses from a workspace to the host: `read_bytes` refuses larger files and
# `diff()` reports them by name and size instead of copying them into the patch (host memory stays bounded
# whatever a sandbox writes; see docs/security.md).
MAX_FILE_BYTES = 16 << 20

MAX_PATH_BYTES = 4095
MAX_NAME_BYTES = 255
MAX_PATTERN_SEGMENTS = 64

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
SPECIAL = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
           stat.S_IFBLK: "a block device"}


S = TypeVar("S")  # what a walk carries per directory (a glob's automaton state)


class PathError(ValueError):
    """A path a model asked for is outside the workspace or otherwise unusable; the message is for the model."""


class Budget(Exception):
    """A walk of the tree ran past its entry or time budget."""


def show(path: str) -> str:
    """A path as quoted in a message: JSON-quoted if it holds control characters, shortened if very long."""
    text = path if path.isprintable() else repr(path)[1:-1]
    return f"'{text}'" if len(text) <= 200 else f"'{text[:120]}…{text[-60:]}' ({len(path)} characters)"


def check_text(value: str, what: str = "path") -> bytes:
    """A model-supplied path or pattern as file-name bytes, or a `PathError` saying why it can never name a file."""
    if "\x00" in value:
        raise PathError(f"the {what} contains a NUL byte, which no file name can hold.")
    try:
        raw = os.fsencode(value)
    except UnicodeEncodeError as e:
        raise PathError(f"the {what} contains {value[e.start]!r}, a lone surrogate that no file name can hold; "
                        "write the name in plain UTF-8.") from None
    if len(raw) > MAX_PATH_BYTES:
        raise PathError(f"the {what} is too long ({len(raw)} bytes; a path is at most {MAX_PATH_BYTES} bytes).")
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > MAX_NAME_BYTES:
        raise PathError(f"the {what} has a name that is too long ({len(longest)} bytes; one file or directory name "
                        f"is at most {MAX_NAME_BYTES} bytes).")
    return raw


def error_for(rel: str, e: OSError) -> Exception:
    """The message a model gets for an OSError on `rel` (other errors stay OSErrors: the loop reports those too)."""
    where = show(rel)
    messages = {
        errno.ELOOP: f"{where} is, or lies under, a symbolic link (it was replaced after the path was checked, or the "
                     "links form a loop); tools do not follow it. Use the real path (`realpath` in run_terminal).",
        errno.ENOTDIR: f"a part of {where} is not a directory.",
        errno.EISDIR: f"{where} is a directory.",
        errno.ENOENT: f"{where} does not exist (or vanished while being used).",
        errno.EACCES: f"permission denied for {where}; check its mode with `ls -l` in run_terminal.",
        errno.EPERM: f"permission denied for {where}; check its mode with `ls -l` in run_terminal.",
        errno.ENAMETOOLONG: f"{where} is too long a path for the filesystem.",
        errno.ENXIO: f"{where} is not a regular file (a FIFO or a socket); tools read and write regular files only.",
    }
    return PathError(messages[e.errno]) if e.errno in messages else e


@contextlib.contextmanager
def model_errors(rel: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise error_for(rel, e) from None


def check_regular(rel: str, st: os.stat_result, limit: int | None = None) -> None:
    """Refuse anything but a regular file (and, with `limit`, one larger than it) without opening it."""
    fmt = stat.S_IFMT(st.st_mode)
    if fmt == stat.S_IFLNK:
        raise error_for(rel, OSError(errno.ELOOP, "symbolic link"))
    if fmt == stat.S_IFDIR:
        raise PathError(f"{show(rel)} is a directory.")
    if fmt != stat.S_IFREG:
        raise PathError(f"{show(rel)} is not a regular file (it is {SPECIAL.get(fmt, 'a special file')}); tools read "
                        "and write regular files only. Remove it with run_terminal (`rm`) if it is in the way.")
    if limit is not None and st.st_size > limit:
        raise too_big(rel, st.st_size, limit)


def too_big(rel: str, size: int | str, limit: int) -> PathError:
    quoted = rel.replace("'", "'\\''")
    return PathError(f"{show(rel)} is {size} bytes, more than the {limit} bytes ({limit >> 20} MiB) a tool reads "
                     f"or writes at once. Look into it piecewise with run_terminal (`sed -n '1,200p' '{quoted}'`, "
                     f"`head -c 20000 '{quoted}'`, `wc -l`) or search it with grep; edit it with a script.")


class Tree:
    """Operations on canonical relative paths ("." is the root) under `root`, never following a symbolic link."""

    def __init__(self, root: Path):
        self.root = root

    @staticmethod
    def parts(rel: str) -> list[str]:
        parts = [] if rel in (".", "") else rel.split("/")
        if any(p in ("", ".", "..") for p in parts):  # `resolve` never returns these; never walk up from the root
            raise PathError(f"{show(rel)} is not a canonical workspace path; pass it through `resolve` first.")
        return parts

    def open_dir(self, parts: list[str], create: bool = False) -> int:
        """A descriptor of root/parts…, each component opened `O_NOFOLLOW` relative to the one before."""
        fd = os.open(self.root, _DIR)
        try:
            for part in parts:
                try:
                    child = os.open(part, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                    child = os.open(part, _DIR, dir_fd=fd)
                except NotADirectoryError:  # what O_DIRECTORY | O_NOFOLLOW says of a link: tell the two apart
                    if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise OSError(errno.ELOOP, "a symbolic link") from None
                    raise
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def open_regular(self, rel: str, limit: int | None = None) -> int:
        """A read-only descriptor of the regular file `rel` (at most `limit` bytes when given), reached without
        following a link: `lstat` before opening (a FIFO is never opened), `fstat` of what was opened."""
        *dirs, name = self.parts(rel) or [""]
        if not name:
            raise PathError("'.' is the workspace root, a directory.")
        with model_errors(rel):
            parent = self.open_dir(dirs)
            try:
                check_regular(rel, os.stat(name, dir_fd=parent, follow_symlinks=False), limit)
                fd = os.open(name, os.O_RDONLY | _FILE, dir_fd=parent)
            finally:
                os.close(parent)
            try:
                check_regular(rel, os.fstat(fd), limit)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def read(self, rel: str, limit: int) -> bytes:
        fd = self.open_regular(rel, limit)
        try:
            with model_errors(rel):
                chunks, total = [], 0
                while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
                    chunks.append(chunk)
                    total += len(chunk)
                    if total > limit:
                        raise too_big(rel, f"more than {limit}", limit)
                return b"".join(chunks)
        finally:
            os.close(fd)

    def write(self, rel: str, data: bytes) -> None:
        *dirs, name = self.parts(rel) or [""]
        if not name:
            raise PathError("'.' is the workspace root, a directory.")
        with model_errors(rel):
            parent = self.open_dir(dirs, create=True)
            try:
                with contextlib.suppress(FileNotFoundError):
                    check_regular(rel, os.stat(name, dir_fd=parent, follow_symlinks=False))
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _FILE, 0o666, dir_fd=parent)
            finally:
                os.close(parent)
            try:
                check_regular(rel, os.fstat(fd))
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)

    def delete(self, rel: str) -> None:
        *dirs, name = self.parts(rel) or [""]
        if not name:
            raise PathError("refusing to delete the workspace root.")
        with model_errors(rel):
            parent = self.open_dir(dirs)
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                    raise PathError(f"{show(rel)} is a directory.")
                os.unlink(name, dir_fd=parent)  # a link itself is removed, never what it points to
            finally:
                os.close(parent)

    def listdir(self, rel: str, max_entries: int) -> list[tuple[str, str, int, str | None]]:
        """(name, kind, size, link target) of at most `max_entries` entries, directories first, then by name."""
        with model_errors(rel):
            fd = self.open_dir(self.parts(rel))
            try:
                with os.scandir(fd) as it:
                    entries = [e for _, e in zip(range(max_entries), it, strict=False)]
                out = []
                for e in entries:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed meanwhile
                    if stat.S_ISLNK(st.st_mode):
                        out.append((e.name, "link", 0, os.readlink(e.name, dir_fd=fd)))
                    elif stat.S_ISDIR(st.st_mode):
                        out.append((e.name, "dir", 0, None))
                    else:
                        out.append((e.name, "file" if stat.S_ISREG(st.st_mode) else "other", st.st_size, None))
            finally:
                os.close(fd)
        return sorted(out, key=lambda t: (t[1] != "dir", t[0]))

    def walk(self, base: str, start: S, step: Callable[[S, str, bool], S | None], descend: Callable[[S], bool], *,
             skip: frozenset[str], max_entries: int | None = None,
             seconds: float | None = None) -> Iterator[tuple[str, bool, bool, S]]:
        """Breadth-first (rel, is_dir, is_link, state) for the entries under `base` that `step(state, name, is_dir)`
        gives a state; directories are entered while `descend(state)`. Raises `Budget` past the budgets."""
        deadline = None if seconds is None else time.monotonic() + seconds
        with model_errors(base):
            fd = self.open_dir(self.parts(base))
        st = os.fstat(fd)
        os.close(fd)
        queue = deque([("" if base == "." else base + "/", start, (st.st_dev, st.st_ino))])
        seen = 0
        while queue:
            prefix, state, identity = queue.popleft()
            try:  # the directory its parent listed, by inode: not a link swapped in on the way since
                fd = os.open(self.root / prefix if prefix else self.root, _DIR)
            except OSError:
                continue  # gone, unreadable, or deeper than PATH_MAX
            try:
                here = os.fstat(fd)
                if (here.st_dev, here.st_ino) != identity:
                    continue
                with os.scandir(fd) as it:
                    listing = []
                    for entry in it:
                        seen += 1
                        if max_entries is not None and seen > max_entries:
                            raise Budget(f"{max_entries} entries")
                        if deadline is not None and seen % 512 == 0 and time.monotonic() > deadline:
                            raise Budget(f"{seconds:g} seconds")
                        if entry.name not in skip:
                            listing.append(entry)
                listing.sort(key=lambda e: e.name)
                for entry in listing:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    is_dir, is_link = stat.S_ISDIR(st.st_mode), stat.S_ISLNK(st.st_mode)
                    new = step(state, entry.name, is_dir)
                    if new is None:
                        continue
                    yield prefix + entry.name, is_dir, is_link, new
                    if is_dir and descend(new):
                        queue.append((prefix + entry.name + "/", new, (st.st_dev, st.st_ino)))
            except OSError:
                continue
            finally:
                os.close(fd)


class Pattern:
    """A glob pattern as an automaton over path names: a state is the set of segments that may match next.

    Segments are regexes for one name (`fnmatch` syntax: `*`, `?`, `[…]`; `*` matches names starting with a dot),
    or `None` for `**`, any number of directories. Repeated `**` are one; `**` inside a name (`**a`) is `*a`;
    empty and `.` segments are dropped; a trailing `/` matches directories only.
    """

    def __init__(self, pattern: str):
        self.dir_only = pattern.endswith("/")
        self.segments: list[re.Pattern[str] | None] = []
        for part in pattern.split("/"):
            if part in ("", "."):
                continue
            if part == "**":
                if not self.segments or self.segments[-1] is not None:
                    self.segments.append(None)
                continue
            self.segments.append(re.compile(fnmatch.translate(part)))
        if len(self.segments) > MAX_PATTERN_SEGMENTS:
            raise PathError(f"the pattern has {len(self.segments)} path segments; at most {MAX_PATTERN_SEGMENTS}.")
        self.end = len(self.segments)
        self.start = self._closure({0})

    def _closure(self, states: set[int]) -> frozenset[int]:
        out = set(states)
        for i in sorted(states):
            while i < self.end and self.segments[i] is None:
                i += 1
                out.add(i)
        return frozenset(out)

    def step(self, states: frozenset[int], name: str, is_dir: bool) -> frozenset[int] | None:
        nxt = set()
        for i in states:
            if i == self.end:
                continue
            seg = self.segments[i]
            if seg is None:
                if is_dir:
                    nxt.add(i)
            elif seg.match(name):
                nxt.add(i + 1)
        return self._closure(nxt) if nxt else None

    def matches(self, states: frozenset[int]) -> bool:
        return self.end in states

    def descend(self, states: frozenset[int]) -> bool:
        return any(i < self.end for i in states)
