"""`tree_diff`: the `git diff` of two directory trees, bounded whatever one of them holds.

The episode's patch is the diff of the workspace against its baseline; in a sandbox, the workspace is what the
model's code made of it, so the diff is computed over hostile trees. Both trees are walked with `lstat` (nothing is
followed): special files (FIFOs, sockets, devices) are never opened and files over `MAX_FILE_BYTES` never copied;
the rest is mirrored into a scratch dir (hard links where possible, else a bounded copy that re-checks what it
opened) as `a/` and `b/` without the ignored directories, and `git diff --no-index --no-prefix` runs there, so the
paths git prints are exactly the conventional `a/x.py` and `b/x.py`. git's output is read one file section at a
time and cut at `max_bytes`. Everything left out is named, JSON-quoted (a crafted name cannot forge a `diff --git`
line), in a leading note before the first `diff --git`, where `git apply` ignores it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from shipyard.harness.confined import IGNORED_DIRS, MAX_FILE_BYTES, is_test_output

DIFF_HEADER = re.compile(r"^diff --git ([ab])/(.+) \1/\2$", re.MULTILINE)

# The most a patch from `tree_diff` holds (UTF-8 bytes). Agents write code, not megabytes; a change whose diff
# does not fit (build output, data) is listed in the patch's leading note instead, like an over-limit file.
MAX_DIFF_BYTES = 8 << 20


@dataclass(frozen=True)
class _Node:
    """One tree entry as `lstat` saw it."""

    kind: Literal["dir", "link", "file", "FIFO", "socket", "device"]
    size: int
    mode: int
    mtime_ns: int
    ctime_ns: int

    def describe(self) -> str:
        if self.kind == "file":
            over = f" (over the {MAX_FILE_BYTES}-byte limit per file)" if self.size > MAX_FILE_BYTES else ""
            return f"a file of {self.size} bytes{over}"
        return {"dir": "a directory", "link": "a symbolic link"}.get(self.kind, f"a {self.kind}")

    @property
    def unfit(self) -> bool:
        """Never copied into a diff: a special file (reading a FIFO blocks), or a file over the limit."""
        return self.kind not in ("dir", "link", "file") or (self.kind == "file" and self.size > MAX_FILE_BYTES)


def tree_diff(before: Path, after: Path, max_bytes: int = MAX_DIFF_BYTES) -> str:
    """`git diff` of two directory trees with paths relative to each root (`a/x.py`, `b/x.py`).

    `git diff --no-index` has no pathspec excludes, so both trees are mirrored (hard links where they can be,
    else bounded copies) into a scratch dir as `a/` and `b/` without the ignored directories; with
    `--no-prefix` the paths git prints are then exactly the conventional `a/x.py` and `b/x.py`.

    Bounded whatever the trees hold (the agent's side is untrusted): special files (FIFOs, sockets, devices) are
    never opened and files over `MAX_FILE_BYTES` never copied — both are checked again on the mirrored inode,
    so swapping one in mid-diff does not help; git's output is read a section (one file) at a time, and a
    section that would take the patch past `max_bytes` is dropped as it streams by. Every change left out
    this way is named, with what it was and is, in `#` lines before the first `diff --git`, which `git apply`
    ignores. Entries identical in every stat field including ctime (which no process can set) are the same
    unmodified inode — a sandbox's overlay seen next to its snapshot — and are not mirrored at all.
    """
    left_out: list[str] = []
    old = _scan(before, left_out)
    new = _scan(after, left_out, keep=old)
    with tempfile.TemporaryDirectory(prefix="shipyard-diff-") as tmp:
        sides = {"a": (before, old), "b": (after, new)}
        for name in sides:
            os.mkdir(os.path.join(tmp, name))
        for rel in sorted(old.keys() | new.keys()):
            x, y = old.get(rel), new.get(rel)
            if x == y and x is not None and x.kind != "dir":
                continue  # the same unmodified inode on both sides
            unfit = any(n is not None and n.unfit for n in (x, y))
            if unfit and not (x and y and (x.kind, x.size, x.mode, x.mtime_ns) == (y.kind, y.size, y.mode, y.mtime_ns)):
                left_out.append(f"{_quote(rel)}: now {y.describe() if y else 'absent'}; before: "
                                f"{x.describe() if x else 'absent'}")
            for name, (root, nodes) in sides.items():
                node = nodes.get(rel)
                if node is not None and (node.kind == "dir" or not unfit):
                    problem = _mirror(node, os.path.join(root, rel), os.path.join(tmp, name, rel))
                    if problem:
                        left_out.append(f"{_quote(rel)}: {problem}")
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(["git", "-c", "core.quotepath=off", "diff", "--no-index", "--binary", "--no-color",
                                     "--no-ext-diff", "--no-prefix", "a", "b"], cwd=tmp, stdout=subprocess.PIPE,
                                    stderr=err)
            with proc.stdout:
                kept = _bounded_sections(proc.stdout, max_bytes, left_out)
            proc.wait()
            err.seek(0)
            stderr = err.read(4096)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"git diff failed: {stderr.decode(errors='replace')}")
    # Added and deleted files name one side twice (`b/x b/x`); write the conventional `a/x b/x`.
    patch = DIFF_HEADER.sub(r"diff --git a/\2 b/\2", "".join(kept))
    if not left_out:
        return patch
    note = [f"# shipyard left {len(left_out)} changed path(s) out of this patch (files over the size limit, special "
            "files, or diffs that did not fit):"]
    return "\n".join([*note, *(f"#   {line}" for line in left_out), ""]) + patch


def _quote(rel: str) -> str:
    return json.dumps(rel, ensure_ascii=False)  # a name with a newline stays on its note line


def _scan(root: Path, left_out: list[str], keep: dict[str, _Node] | None = None) -> dict[str, _Node]:
    """Every entry under `root` but the ignored directories, by relative path, from `lstat` (nothing followed). With
    `keep` (the baseline's entries), also without what test runs write (`is_test_output`) unless the baseline has
    it: a project's own `htmlcov/` package or `coverage.xml` fixture is diffed like any file."""
    nodes: dict[str, _Node] = {}
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            with os.scandir(os.path.join(root, rel_dir)) as it:
                entries = [(e.name, e.stat(follow_symlinks=False)) for e in it if e.name not in IGNORED_DIRS and not (
                    keep is not None and is_test_output(e.name) and _join(rel_dir, e.name) not in keep)]
        except OSError as e:
            if rel_dir:
                left_out.append(f"{_quote(rel_dir)}: a directory that could not be read ({e.strerror})")
            continue
        for name, st in entries:
            rel = _join(rel_dir, name)
            nodes[rel] = _Node(_kind(st.st_mode), st.st_size, st.st_mode, st.st_mtime_ns, st.st_ctime_ns)
            if nodes[rel].kind == "dir":
                stack.append(rel)
    return nodes


def _join(rel_dir: str, name: str) -> str:
    return f"{rel_dir}/{name}" if rel_dir else name


def _kind(mode: int) -> Literal["dir", "link", "file", "FIFO", "socket", "device"]:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    return "FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else "device"


def _mirror(node: _Node, src: str, dst: str) -> str | None:
    """Recreate `src` at `dst` (a file: hard link, else a bounded copy); why not, if it changed under us."""
    try:
        if node.kind == "dir":
            os.makedirs(dst, exist_ok=True)
        elif node.kind == "link":
            os.symlink(os.readlink(src), dst)
        else:
            try:
                os.link(src, dst, follow_symlinks=False)
            except OSError:  # another filesystem (a sandbox's overlay and /tmp), or not allowed
                return _copy_bounded(src, dst)
            st = os.lstat(dst)  # the inode itself now, whatever is swapped in at `src` later
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
                os.unlink(dst)
                return f"became {_Node(_kind(st.st_mode), st.st_size, 0, 0, 0).describe()} during the diff"
    except FileNotFoundError:
        pass  # gone since the scan: absent on this side
    return None


def _copy_bounded(src: str, dst: str) -> str | None:
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:  # a symlink or a socket swapped in since the scan
        return f"could not be read during the diff ({e.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
            return f"became {_Node(_kind(st.st_mode), st.st_size, 0, 0, 0).describe()} during the diff"
        room = MAX_FILE_BYTES + 1
        with open(dst, "wb") as out:
            while room and (chunk := os.read(fd, min(room, 1 << 20))):
                out.write(chunk)
                room -= len(chunk)
        if not room:
            os.unlink(dst)
            return f"grew past {MAX_FILE_BYTES} bytes during the diff"
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    finally:
        os.close(fd)
    return None


def _bounded_sections(stream: BinaryIO, max_bytes: int, left_out: list[str]) -> list[str]:
    """git's output, one file's section at a time, keeping those that fit in `max_bytes` (UTF-8, after decoding
    with replacement) in order; the others are named in `left_out`. Memory stays within `max_bytes` plus a line."""
    kept: list[str] = []
    total = 0
    header, body, size, over = b"", bytearray(), 0, False

    def finish() -> None:
        nonlocal total
        text = body.decode(errors="replace") if not over else ""
        cost = len(text.encode()) if not over else 0
        if over or total + cost > max_bytes:
            match = DIFF_HEADER.match(header.decode(errors="replace").rstrip("\n"))
            name = _quote(match.group(2)) if match else header.decode(errors="replace").strip()
            left_out.append(f"{name}: its diff of {size} bytes does not fit in the patch's {max_bytes}")
        elif size:
            kept.append(text)
            total += cost

    at_line_start = True
    while chunk := stream.readline(1 << 16):
        if at_line_start and chunk.startswith(b"diff --git "):
            finish()
            header, body, size, over = chunk, bytearray(), 0, False
        size += len(chunk)
        if not over:
            body += chunk
            if total + len(body) > max_bytes:
                over, body = True, bytearray()
        at_line_start = chunk.endswith(b"\n")
    finish()
    return kept
