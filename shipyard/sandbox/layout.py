"""The host directories of one sandbox, the disk quota of its upper dir, and recovery after a crash.

Each sandbox has a directory `STATE/sandboxes/ID` holding its private `/etc` files and `fs/{upper,work}`, the
overlay's upper and work dirs. Everything the sandbox writes to `/workspace` lands in `fs/upper`.

**Disk quota.** Per-file size is capped by `RLIMIT_FSIZE`, but a sandbox could still fill the host's disk with
many files. When shipyard runs as root, `fs` is a tmpfs mounted with `size=disk_mb` (a mount(2) call, ~0.1 ms):
writes past the quota fail with `ENOSPC` inside the sandbox, and removal is an unmount. tmpfs pages are charged
to the memory cgroup of the process that writes them, so what a sandbox stores in its upper dir also counts
against its memory limit (measured files are small for coding tasks: edits, caches, test outputs). Without root
nothing can be mounted; the host notes say the quota is not enforced there.

**Crash recovery.** Every sandbox dir records its owner (pid and start time). `recover_stale()` unmounts and
deletes the dirs, and removes the cgroups, of sandboxes whose owner process is gone — a killed environment
server leaves nothing behind once any shipyard process starts again on the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from shipyard.sandbox.host import CGROUP_ROOT, Host, host, private_dir

SANDBOX_UID = SANDBOX_GID = 1000
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2
_libc = ctypes.CDLL(None, use_errno=True)


def mount_tmpfs(target: Path, size_mb: int, uid: int, gid: int) -> None:
    options = f"size={size_mb}m,mode=0755,uid={uid},gid={gid}".encode()
    if _libc.mount(b"shipyard", str(target).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting the disk-quota tmpfs at {target}: {os.strerror(err)}")


def unmount(target: Path) -> None:
    """Detach `target`; its memory is freed when the last process using it (none, after a kill) lets go."""
    if _libc.umount2(str(target).encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unmounting {target}: {os.strerror(err)}")


def mounted_under(root: Path) -> list[Path]:
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [Path(p) for p in points if p.startswith(prefix)]


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks since boot


def owner_record() -> str:
    """This process as an owner file records it: pid and start time (a pid alone could be reused)."""
    return f"{os.getpid()} {_start_time(os.getpid())}\n"


def write_owner(path: Path) -> None:
    """Record this process as the owner in `path` atomically: recovery elsewhere never reads it half-written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(owner_record())
    os.replace(tmp, path)


OWNER_GRACE = 60.0  # seconds an entry without a readable owner record counts as being made, not abandoned


def owner_alive(owner_file: Path, entry: Path | None = None) -> bool:
    """Whether the process that `owner_file` records still runs. A missing, empty or partial record means the
    entry (`entry`, default the record itself) is still being made unless it is older than `OWNER_GRACE`: its
    creator makes the entry first and writes the record just after, and another process's recovery may look
    in between."""
    try:
        pid, started = owner_file.read_text().split()
    except (OSError, ValueError):
        try:
            return time.time() - (entry or owner_file).lstat().st_mtime < OWNER_GRACE
        except OSError:
            return False
    return _start_time(int(pid)) == started


@dataclass
class Layout:
    root: Path
    quota: bool = False  # `fs` is a size-capped tmpfs

    @property
    def fs(self) -> Path:
        return self.root / "fs"

    @property
    def upper(self) -> Path:
        return self.fs / "upper"

    @property
    def work(self) -> Path:
        return self.fs / "work"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @classmethod
    def create(cls, h: Host, sandbox_id: str, disk_mb: int) -> Layout:
        _recover_once(h.state_dir)
        layout = cls(h.state_dir / "sandboxes" / sandbox_id, quota=h.disk_quota)
        layout.etc.mkdir(parents=True)
        try:
            layout._populate(h, disk_mb)
        except BaseException:  # a failed mount or write leaves no dir or mount behind
            layout.remove()
            raise
        return layout

    def _populate(self, h: Host, disk_mb: int) -> None:
        layout = self
        private_dir(h, layout.root.parent)
        write_owner(layout.root / "owner")
        layout.fs.mkdir()
        if layout.quota:
            mount_tmpfs(layout.fs, disk_mb, h.uid, h.gid)
        (layout.etc / "passwd").write_text(f"root:x:0:0:root:/root:/bin/bash\nagent:x:{SANDBOX_UID}:{SANDBOX_GID}:"
                                           "agent:/home/agent:/bin/bash\nnobody:x:65534:65534::/:/bin/false\n")
        (layout.etc / "group").write_text(f"root:x:0:\nagent:x:{SANDBOX_GID}:\nnogroup:x:65534:\n")
        (layout.etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
        (layout.etc / "hostname").write_text("sandbox\n")
        for p in (layout.root, layout.etc, *layout.etc.iterdir()):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        for d in (layout.upper, layout.work):
            d.mkdir()
            if h.drop_privileges:
                os.chown(d, h.uid, h.gid)

    def remove(self) -> None:
        """Unmount the quota tmpfs and delete the sandbox's dirs. overlayfs leaves `work/work` with mode 000, which
        a non-root owner must first open up (root removes it regardless)."""

        def open_up(func, path, _exc) -> None:
            os.chmod(os.path.dirname(path), 0o700)
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, 0o700)
                shutil.rmtree(path, onerror=open_up)
            else:
                func(path)

        if self.root.exists():
            for point in mounted_under(self.root):
                unmount(point)
            shutil.rmtree(self.root, onerror=open_up)


def shipyard_cgroups(owner: int | None = None) -> list[Path]:
    """The sandbox cgroups on this host (v2, and the v1 memory, pids and cpuacct hierarchies): every one, or those
    of the sandboxes process `owner` started."""
    pattern = f"shipyard-{owner}-*" if owner is not None else "shipyard-*-*"
    return [p for sub in ("", "memory", "pids", "cpuacct") for p in (CGROUP_ROOT / sub).glob(pattern)]


def leftovers(owner: int | None = None) -> list[str]:
    """What the sandboxes that process `owner` (default: this one) started still hold on this host: cgroups, sandbox
    dirs, mounts, live bwrap children. Empty once each of them is closed. Other processes' sandboxes (a second test
    run, an environment server) are not looked at, so a check of it holds whatever else runs on the machine."""
    owner = os.getpid() if owner is None else owner
    found = [f"cgroup {g}" for g in shipyard_cgroups(owner)]
    base = host().state_dir / "sandboxes"
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            if int((d / "owner").read_text().split()[0]) == owner:
                found.append(f"sandbox dir {d}")
                found += [f"mount {m}" for m in mounted_under(d)]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            name, fields = stat.read_text().rsplit(")", 1)
            state, ppid = fields.split()[:2]
            if int(ppid) == owner and name.endswith("(bwrap") and state != "Z":
                found.append(f"bwrap process {stat.parent.name}")
    return found


def kill_members(groups: list[Path], wait: float) -> bool:
    """SIGKILL every process in the cgroups (whatever session or group it escaped to) until none is left; whether
    they emptied within `wait` seconds. A cgroup with members cannot be removed."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        pids = {int(p) for g in groups for p in (g / "cgroup.procs").read_text().split()}
        if not pids:
            return True
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    return not groups


def recover_stale(h: Host) -> list[str]:
    """Remove the sandboxes (processes, mounts, dirs, cgroups) left by shipyard processes that died; their ids."""
    recovered = []
    for group in shipyard_cgroups():
        owner = group.name.split("-")[1]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            # Its sandbox's processes die with their bwrap when the owner crashes, but asynchronously.
            with contextlib.suppress(OSError):
                kill_members([group], wait=2.0)
    base = h.state_dir / "sandboxes"
    for d in sorted(base.iterdir()) if base.is_dir() else []:
        if d.is_dir() and not owner_alive(d / "owner", d):
            with contextlib.suppress(OSError):
                Layout(d).remove()
                recovered.append(d.name)
    for group in shipyard_cgroups():
        owner = group.name.split("-")[1]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            with contextlib.suppress(OSError):  # a member that survived SIGKILL for 2 s: next time
                group.rmdir()
    return recovered


@cache
def _recover_once(state_dir: Path) -> None:
    recover_stale(host())
