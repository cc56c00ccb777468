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

import errno
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Literal, Protocol

from shipyard.harness.confined import Budget, PathError, Pattern, Tree, check_text, error_for, show
from shipyard.harness.process import ExecResult, Job, local_job, run_process, spawn_process

# Directories that are never part of a baseline, a diff or a glob: VCS metadata, caches, virtual environments.
IGNORED_DIRS = frozenset({".git", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache",
                          ".ruff_cache", ".hypothesis", ".tox"})

Kind = Literal["file", "dir", "missing", "other"]

# The most bytes of one file that crosses from a workspace to the host: `read_bytes` refuses larger files and
# `diff()` reports them by name and size instead of copying them into the patch (host memory stays bounded
# whatever a sandbox writes; see docs/security.md).
MAX_FILE_BYTES = 16 << 20
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
            shutil.copytree(self.root, self._baseline, symlinks=True, ignore=shutil.ignore_patterns(*IGNORED_DIRS))
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
    old, new = _scan(before, left_out), _scan(after, left_out)
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


def _scan(root: Path, left_out: list[str]) -> dict[str, _Node]:
    """Every entry under `root` but the ignored directories, by relative path, from `lstat` (nothing followed)."""
    nodes: dict[str, _Node] = {}
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            with os.scandir(os.path.join(root, rel_dir)) as it:
                entries = [(e.name, e.stat(follow_symlinks=False)) for e in it if e.name not in IGNORED_DIRS]
        except OSError as e:
            if rel_dir:
                left_out.append(f"{_quote(rel_dir)}: a directory that could not be read ({e.strerror})")
            continue
        for name, st in entries:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            nodes[rel] = _Node(_kind(st.st_mode), st.st_size, st.st_mode, st.st_mtime_ns, st.st_ctime_ns)
            if nodes[rel].kind == "dir":
                stack.append(rel)
    return nodes


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
