"""Read-only snapshots that sandboxes overlay: a repository (and its prepared environment) frozen once.

A snapshot is a copy of the source tree owned by the sandbox's host uid. Ownership matters: inside the sandbox,
files owned by an unmapped uid (host root) appear as `nobody` and cannot be modified, so overlay copy-up of an
edited file would fail. Hard links cannot be used for the same reason — re-owning them would change the source.
The copy is made once per snapshot (per task); every episode over it then costs only an empty overlay upper dir.

**The copy trusts nothing in the tree.** Sources come from clients of the environment server and from the
repositories tasks are made of, and an episode's upper dir is written by the model itself, possibly while it is
being copied. So the copy (`copy_tree`) walks the tree itself instead of running `cp -a`:

* Every directory is opened relative to its parent's descriptor with `O_NOFOLLOW`, so a directory swapped for a
  symlink mid-copy (a background job in the sandbox can do that in a loop) fails instead of leading the copy, as
  root, into the host's `/etc`. Symlinks are copied as links, never followed.
* Bounded (`CopyBounds`): entries, bytes actually read (a `/proc` file reports size 0 and still has content),
  depth. Past a bound the copy stops at once. The environment server's copies default to 2 GiB and 200 000
  entries; the operator's own trees (`TRUSTED`, tasks and the CLI) to 32 GiB and a million.
* Special files (FIFOs, sockets, devices) are refused: opening a FIFO blocks, and a device is not a file a
  repository needs. Symlinks that lead out of the source (resolved on the host, links through links included) are
  refused too unless the caller keeps them (`keep_outward_links`: a task's `.venv/bin/python` points at the
  interpreter; inside the sandbox such a link resolves in the sandbox's own filesystem, where it grants nothing).
* A refusal names the offending path (`SnapshotRefused`), and a refused or failed copy leaves nothing behind: it is
  built under a unique hidden name and renamed into place only when complete.
* Names are one path component (`check_name`), never a path.

Data is copied with `copy_file_range` (in-kernel; a reflink where the filesystem supports one), falling back to
read/write for files that report no size (procfs-like) or filesystems without it.

An episode can itself become a snapshot (`snapshot_episode`: continue a task from a checkpointed state, or fork
many rollouts from one prefix). The merged view exists only inside the sandbox, so it is rebuilt on the host from
the overlay's two layers: copy the lower, then apply the upper — overlayfs records a deletion as a whiteout (a 0:0
character device) and a directory replaced wholesale as an opaque directory (`*.overlay.opaque` = "y"). Both
steps share one set of bounds.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import os
import re
import stat
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from shipyard.errors import InputNotFound, UsageError, UserError
from shipyard.sandbox.host import Host, private_dir
from shipyard.sandbox.layout import owner_alive, write_owner

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit, with no '..'"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CHUNK = 1 << 22


def check_name(name: str, what: str = "snapshot name") -> str:
    """`name` if it is a valid snapshot or sandbox id (one path component), else UsageError (a ValueError) saying what
    is."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise UsageError(f"{what} {name!r} is invalid: use {NAME_RULE}")
    return name


class SnapshotRefused(UserError, ValueError):
    """The tree cannot become a snapshot (over a bound, a special file, a link out of it); nothing was left."""


@dataclass(frozen=True)
class CopyBounds:
    max_bytes: int = 2 << 30  # file contents, as read
    max_files: int = 200_000  # entries of every kind
    max_depth: int = 128  # directory levels (each open level holds two file descriptors)
    keep_outward_links: bool = False  # copy symlinks that lead out of the source instead of refusing them


# What make_snapshot and snapshot_episode use when their caller names no bounds: the operator's own trees (a task's
# repository with its prepared environment, GPU wheels included), still finite.
TRUSTED = CopyBounds(max_bytes=32 << 30, max_files=1_000_000, keep_outward_links=True)


class Copier:
    """One bounded copy (or upper-dir application): its counters, the owner it gives files, its source's root."""

    def __init__(self, bounds: CopyBounds, owner: tuple[int, int] | None, source: str, label: str):
        self.bounds, self.owner, self.source, self.label = bounds, owner, source, label
        self.files = 0
        self.bytes = 0
        self.at = "."  # the path being copied, for error messages

    def refuse(self, rel: str, why: str) -> SnapshotRefused:
        return SnapshotRefused(f"cannot snapshot {self.label}: {rel or '.'} {why}")

    def failed(self, e: OSError) -> SnapshotRefused:
        return SnapshotRefused(f"cannot snapshot {self.label}: copying {self.at} failed: {e.strerror or e}")

    def names(self, fd: int, rel: str) -> list[str]:
        """The entries of the open directory `fd`, counted against the file bound as they are read."""
        names = []
        with os.scandir(fd) as it:
            for entry in it:
                self.files += 1
                if self.files > self.bounds.max_files:
                    raise SnapshotRefused(f"cannot snapshot {self.label}: it has more than {self.bounds.max_files} "
                                          f"files (reached in {rel or '.'}); snapshot a smaller tree")
                names.append(entry.name)
        return sorted(names)

    def finish(self, fd: int, st: os.stat_result) -> None:
        """Mode, times and owner of a copied file or directory, from its source's `st`."""
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o777)
        if self.owner is not None:
            os.fchown(fd, *self.owner)
        os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))

    def tree(self, src: int, dst: int, rel: str, depth: int) -> None:
        """Copy the contents of directory `src` into the empty directory `dst`."""
        if depth > self.bounds.max_depth:
            raise self.refuse(rel, f"is more than {self.bounds.max_depth} directories deep")
        for name in self.names(src, rel):
            self.at = path = f"{rel}/{name}" if rel else name
            st = os.stat(name, dir_fd=src, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                self.directory(src, dst, name, path, st, depth)
            else:
                self.entry(src, dst, name, path, st)

    def directory(self, src: int, dst: int, name: str, path: str, st: os.stat_result, depth: int) -> None:
        os.mkdir(name, 0o700, dir_fd=dst)
        sfd = os.open(name, DIR_FLAGS, dir_fd=src)
        try:
            dfd = os.open(name, DIR_FLAGS, dir_fd=dst)
            try:
                self.tree(sfd, dfd, path, depth + 1)
                self.finish(dfd, st)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)

    def entry(self, src: int, dst: int, name: str, path: str, st: os.stat_result) -> None:
        """Copy one non-directory: a regular file's data, a symlink as a link; anything else is refused."""
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(name, dir_fd=src)
            if not self.bounds.keep_outward_links and not _inside(os.path.join(self.source, path), self.source):
                raise self.refuse(path, f"is a symlink to {target!r}, which leads out of the tree (refused: copy "
                                  "what it points to into the tree instead)")
            os.symlink(target, name, dir_fd=dst)
            if self.owner is not None:
                os.chown(name, *self.owner, dir_fd=dst, follow_symlinks=False)
            return
        if not stat.S_ISREG(st.st_mode):
            raise self.refuse(path, f"is a {special_kind(st.st_mode)}, not a regular file, directory or symlink "
                                    "(refused: remove it from the tree)")
        sfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src)
        try:
            if not stat.S_ISREG(os.fstat(sfd).st_mode):  # swapped since it was looked at
                raise self.refuse(path, "changed into a special file while being copied")
            dfd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=dst)
            try:
                self.data(sfd, dfd, path, st.st_size)
                self.finish(dfd, st)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)

    def data(self, sfd: int, dfd: int, path: str, size: int) -> None:
        in_kernel = size > 0  # pseudo-files report size 0 and only read() gets their data
        copied = 0
        while True:
            room = self.bounds.max_bytes - self.bytes
            want = min(CHUNK, room + 1)
            n = 0
            if in_kernel:
                try:
                    n = os.copy_file_range(sfd, dfd, want)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF):
                        raise
                    n = -1
                if n < 0 or (n == 0 and copied == 0):  # unsupported here, or a file that claims a size it lacks
                    in_kernel = False
                    continue
            else:
                chunk = os.read(sfd, min(want, 1 << 20))
                n = len(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(dfd, view):]
            if n == 0:
                return
            copied += n
            self.bytes += n
            if self.bytes > self.bounds.max_bytes:
                raise SnapshotRefused(f"cannot snapshot {self.label}: it holds more than {self.bounds.max_bytes} "
                                      f"bytes (reached at {path}); snapshot a smaller tree")


def _inside(path: str, root: str) -> bool:
    """Whether `path` (a link in the tree rooted at the real path `root`) resolves, on this host, inside `root`."""
    real = os.path.realpath(path)
    return real == root or real.startswith(root.rstrip("/") + "/")


def special_kind(mode: int) -> str:
    """What a non-regular, non-directory, non-link file is, in words."""
    for test, kind in ((stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return kind
    return "special file"


def _open_root(source: Path, within: Sequence[Path]) -> tuple[int, str]:
    """The source directory, opened, and its real path. Without `within` (the operator's own tree, already resolved
    by the caller) it is opened as named. With `within` (a client's path) it is opened by walking from the allowed
    root one component at a time, never following a link: the path is judged by what is opened, not by what a
    resolution before or after says (a link through `/proc/PID/root` resolves to a path inside the root while
    opening another mount namespace's view of anything, and a directory swapped for a link meanwhile would pass a
    check made first)."""
    if not within:
        fd = os.open(source, DIR_FLAGS)
        return fd, os.readlink(f"/proc/self/fd/{fd}")
    try:
        return open_beneath(os.fspath(source), within), os.path.normpath(source)
    except Beneath as e:
        if e.kind == "outside":
            raise PermissionError(f"{source} is outside the allowed roots ({', '.join(map(str, within))})") from None
        if e.kind == "link":
            raise PermissionError(f"{source} goes through a symbolic link ({e.where} -> {e.target}); snapshot "
                                  "sources are not followed through links: give the directory's real path") from None
        if e.kind == "missing":
            raise InputNotFound(f"{source} is not a directory ({e.where}: {e.strerror})") from None
        raise OSError(e.errno, e.strerror, e.where) from None


class Beneath(OSError):
    """`open_beneath` refused a path: `kind` is outside (no allowed root holds it), link (a component is a symbolic
    link; `target` is where it points), missing (a component is absent or not a directory) or unopenable."""

    def __init__(self, kind: str, where: str, err: OSError | None = None, target: str = ""):
        super().__init__(err.errno if err else errno.EACCES, err.strerror if err else "outside the allowed roots")
        self.kind, self.where, self.target = kind, where, target


def open_beneath(path: str, roots: Sequence[Path]) -> int:
    """The directory `path` names (`..` taken lexically), opened by walking from the allowed root that holds it one
    component at a time, never following a link: the path is judged by what is opened, not by what a resolution
    before or after says. `Beneath` says why not; callers word it for their users (the snapshot API, the env
    server's task endpoints)."""
    path = os.path.normpath(path)
    for root in map(str, roots):
        if path == root or path.startswith(root.rstrip("/") + "/"):
            rest = [part for part in path[len(root):].split("/") if part]
            break
    else:
        raise Beneath("outside", path)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(rest):
            try:
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                where = os.path.join(root, *rest[: i + 1])
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                    raise Beneath("link", where, e, os.readlink(part, dir_fd=fd)) from None
                raise Beneath("missing" if e.errno in (errno.ENOENT, errno.ENOTDIR) else "unopenable", where, e) \
                    from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_at(dir_fd: int, name: str) -> None:
    """Delete `name` in `dir_fd` and everything under it, opening up directories made read-only by their copy."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o700)
        for child in os.listdir(fd):
            _remove_at(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _remove(path: Path) -> None:
    parent = os.open(path.parent, DIR_FLAGS)
    try:
        _remove_at(parent, path.name)
    finally:
        os.close(parent)


def remove_snapshot(path: Path) -> None:
    """Delete a snapshot and its owner record (best effort: never raises)."""
    path = Path(path)
    with contextlib.suppress(OSError):
        _remove(path)
    with contextlib.suppress(OSError):
        (path.parent / f".{path.name}.owner").unlink()


def _owner(h: Host) -> tuple[int, int] | None:
    return (h.uid, h.gid) if h.drop_privileges else None


def _build(h: Host, name: str | None, fill) -> Path:
    """Run `fill(partial_dir_fd)` on a new hidden directory and rename it to the snapshot `name`; on any failure
    nothing is left."""
    name = check_name(name) if name is not None else uuid.uuid4().hex[:12]
    snaps = private_dir(h, h.state_dir / "snapshots")
    dest = snaps / name
    if os.path.lexists(dest):
        raise FileExistsError(f"a snapshot named {name!r} already exists in {snaps}; choose another name")
    _recover_once(snaps)
    owner = snaps / f".{name}.owner"  # beside it, not in it: a sandbox over the snapshot must not see it
    partial = snaps / f".{name}.{uuid.uuid4().hex[:8]}.partial"
    write_owner(owner)
    try:
        os.mkdir(partial, 0o700)
        fd = os.open(partial, DIR_FLAGS)
        try:
            fill(fd)
        finally:
            os.close(fd)
        try:
            os.rename(partial, dest)  # replaces nothing but an empty directory: a racing twin loses cleanly
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(f"a snapshot named {name!r} already exists in {snaps}") from None
            raise
    except BaseException:
        remove_snapshot(partial)
        with contextlib.suppress(OSError):
            owner.unlink()
        raise
    return dest


def recover_snapshots(snaps: Path) -> list[str]:
    """Remove the snapshots (and partial copies) whose creating process is gone — a killed environment server's —
    their names. Every snapshot in the state dir lives as long as the process that made it (a server, a grade, a
    `sandbox exec`), which records itself in `.NAME.owner` beside it."""
    removed = []
    for owner in sorted(snaps.glob(".*.owner")):
        if owner_alive(owner):
            continue
        name = owner.name[1:].removesuffix(".owner")
        for path in (snaps / name, *snaps.glob(f".{glob.escape(name)}.*.partial")):
            if os.path.lexists(path):
                remove_snapshot(path)
                removed.append(path.name)
        with contextlib.suppress(OSError):
            owner.unlink()
    return removed


@functools.cache
def _recover_once(snaps: Path) -> None:
    recover_snapshots(snaps)


def copy_tree(source: Path, dest_fd: int, bounds: CopyBounds, owner: tuple[int, int] | None,
              within: Sequence[Path] = ()) -> Copier:
    """Copy the directory `source` into the empty open directory `dest_fd` (see the module docstring); the copy's
    counters. OSErrors reading the tree come back as `SnapshotRefused` naming the path."""
    try:
        src, real = _open_root(Path(source), within)
    except NotADirectoryError:
        raise InputNotFound(f"{source} is not a directory") from None
    copy = Copier(bounds, owner, real, str(source))
    try:
        copy.tree(src, dest_fd, "", 0)
        copy.finish(dest_fd, os.fstat(src))
    except OSError as e:
        raise copy.failed(e) from None
    finally:
        os.close(src)
    return copy


def make_snapshot(source: str | Path, h: Host, name: str | None = None, *, bounds: CopyBounds | None = None,
                  within: Sequence[Path] = ()) -> Path:
    """A new snapshot of the directory `source` named `name` (default: a random id); its path. `bounds` default to
    `TRUSTED` (outward links kept) for the operator's own trees; `within`: real paths `source` must lie under."""
    if not within:  # the operator's own path: resolved here; a client's path is walked from its root instead
        source = Path(source).resolve()
        if not source.is_dir():
            raise InputNotFound(f"{source} is not a directory")
    return _build(h, name, lambda fd: copy_tree(Path(source), fd, bounds or TRUSTED, _owner(h), within))


@contextlib.contextmanager
def snapshot_of(source: str | Path, h: Host, name: str | None = None, *, bounds: CopyBounds | None = None,
                within: Sequence[Path] = ()) -> Iterator[Path]:
    """`make_snapshot` for the length of a with-block: `with snapshot_of(repo, host()) as snap: Sandbox(snap)…`. The
    snapshot is removed when the block ends, however it ends (a leftover of a killed process is removed by the next
    process's recovery: its owner record names a dead pid)."""
    path = make_snapshot(source, h, name, bounds=bounds, within=within)
    try:
        yield path
    finally:
        remove_snapshot(path)


def snapshot_episode(lower: Path, upper: Path, h: Host, name: str | None = None, *,
                     bounds: CopyBounds | None = None) -> Path:
    """A new snapshot holding what a sandbox over `lower` sees now (its upper dir applied). Take it between calls:
    files being written meanwhile may be caught half-written. Links the model made are kept as links (they resolve
    inside sandboxes only); special files it made are refused."""
    bounds = replace(bounds or TRUSTED, keep_outward_links=True)

    def fill(fd: int) -> None:
        copy = copy_tree(lower, fd, bounds, _owner(h))
        up = os.open(upper, DIR_FLAGS)
        apply = Copier(bounds, _owner(h), os.readlink(f"/proc/self/fd/{up}"), "the sandbox's workspace")
        apply.files, apply.bytes = copy.files, copy.bytes
        try:
            _apply_upper(apply, up, fd, "", 0)
        except OSError as e:
            raise apply.failed(e) from None
        finally:
            os.close(up)

    return _build(h, name, fill)


def _opaque(fd: int) -> bool:
    for attr in ("user.overlay.opaque", "trusted.overlay.opaque"):
        with contextlib.suppress(OSError):
            if os.getxattr(fd, attr) == b"y":
                return True
    return False


def _apply_upper(copy: Copier, up: int, dst: int, rel: str, depth: int) -> None:
    """Apply the overlay upper dir `up` onto the copied lower `dst`: whiteouts delete, opaque directories replace,
    everything else overwrites. Nothing of overlayfs's own bookkeeping (xattrs) is carried over."""
    if depth > copy.bounds.max_depth:
        raise copy.refuse(rel, f"is more than {copy.bounds.max_depth} directories deep")
    for name in copy.names(up, rel):
        copy.at = path = f"{rel}/{name}" if rel else name
        st = os.stat(name, dir_fd=up, follow_symlinks=False)
        try:
            old = os.stat(name, dir_fd=dst, follow_symlinks=False)
        except FileNotFoundError:
            old = None
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # whiteout: deleted in the episode
            if old is not None:
                _remove_at(dst, name)
            continue
        if not stat.S_ISDIR(st.st_mode):
            if old is not None:
                _remove_at(dst, name)
            copy.entry(up, dst, name, path, st)
            continue
        ufd = os.open(name, DIR_FLAGS, dir_fd=up)
        try:
            if old is not None and (not stat.S_ISDIR(old.st_mode) or _opaque(ufd)):
                _remove_at(dst, name)
                old = None
            if old is None:
                os.mkdir(name, 0o700, dir_fd=dst)
            dfd = os.open(name, DIR_FLAGS, dir_fd=dst)
            try:
                os.fchmod(dfd, 0o700)  # a read-only directory of the lower must take the episode's entries
                _apply_upper(copy, ufd, dfd, path, depth + 1)
                copy.finish(dfd, st)
            finally:
                os.close(dfd)
        finally:
            os.close(ufd)
