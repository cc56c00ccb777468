"""Launching processes inside a bubblewrap sandbox over a copy-on-write workspace.

The sandbox (bubblewrap >= 0.9, for `--overlay`):

* `--unshare-all --unshare-user --disable-userns --die-with-parent --new-session --cap-drop ALL`: own user, pid,
  net, ipc, uts and cgroup namespaces, and no nested user namespaces (the usual first step of a kernel exploit);
  no capabilities; it dies with its launcher; no controlling terminal to inject into.
* uid/gid 1000 inside ("agent"), mapped to an unprivileged host uid (see `shipyard.sandbox.host`).
* Network: only the sandbox's own loopback; the host's 127.0.0.1 is another namespace, unreachable.
* Filesystem: `/usr` (and the merged-usr links) read-only; a minimal private `/etc` (no host secrets); the
  Python runtime (base prefix and the virtual environment shipyard runs in) read-only at its own paths;
  private `/tmp`, `/dev` and `/proc`; the workspace at
  `/workspace` is an overlay of a per-sandbox upper dir over the read-only snapshot, which is also visible,
  read-only, at `/snapshot` (the baseline for diffs).
* Limits: rlimits set in the launcher's child before it execs bwrap (inherited by everything inside), plus a
  per-sandbox cgroup (memory, pids) where the host has one, joined before the privilege drop.

CPU accounting: what runs in a sandbox is not in its launcher's `RUSAGE_CHILDREN` (its processes die with the pid
namespace, reaped by no one we wait for), so the cgroup is the only place its CPU time is counted: `cpu.stat`
(v2) or `cpuacct.usage` (v1, when the cpuacct hierarchy is writable), read just before the cgroup is removed and
summed per process in `sandbox_cpu()`. Benchmarks that report work per CPU-hour add it to their own rusage.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import uuid
from dataclasses import dataclass, fields
from pathlib import Path

from shipyard.sandbox.host import CGROUP_ROOT, Host
from shipyard.sandbox.layout import SANDBOX_GID, SANDBOX_UID, Layout, kill_members

WORKSPACE, SNAPSHOT = "/workspace", "/snapshot"
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates", "localtime",
             "nsswitch.conf", "gitconfig", "mime.types")


@dataclass(frozen=True)
class Limits:
    memory_mb: int = 4096
    pids: int = 512
    cpu_seconds: int = 3600
    file_size_mb: int = 2048
    open_files: int = 4096
    disk_mb: int = 4096  # the upper dir: everything written to /workspace (see shipyard.sandbox.layout)

    def __post_init__(self) -> None:
        # 0 or -1 would mean "unlimited" to setrlimit, cgroups or tmpfs: refuse them here, for every caller.
        bad = {f.name: getattr(self, f.name) for f in fields(self)
               if type(getattr(self, f.name)) is not int or getattr(self, f.name) < 1}
        if bad:
            raise ValueError(f"sandbox limits must be whole numbers >= 1, got {bad}")


def _usr_links() -> list[str]:
    """Recreate the host's top-level system dirs: merged-usr symlinks, or read-only binds."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib64", "lib32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), f"/{name}"]
        elif path.is_dir():
            args += ["--ro-bind", str(path), f"/{name}"]
    return args


def bwrap_argv(h: Host, layout: Layout, snapshot: Path, command: list[str], *, cwd: str = WORKSPACE,
               env: dict[str, str] | None = None, extra_ro_binds: tuple[tuple[str, str], ...] = ()) -> list[str]:
    argv = [h.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID), "--hostname", "sandbox", *_usr_links(),
            "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run", "--tmpfs", "/home/agent"]
    for name in ETC_FILES:
        if Path("/etc", name).exists():
            argv += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for name in ("passwd", "group", "hosts", "hostname"):
        argv += ["--ro-bind", str(layout.etc / name), f"/etc/{name}"]
    for src, dest in h.binds:  # the Python runtime: base prefix and the virtual environment, at their own paths
        argv += ["--ro-bind", src, dest]
    for src, dest in extra_ro_binds:
        argv += ["--ro-bind", src, dest]
    argv += ["--ro-bind", str(snapshot), SNAPSHOT,
             "--overlay-src", str(snapshot), "--overlay", str(layout.upper), str(layout.work), WORKSPACE,
             "--remount-ro", "/", "--chdir", cwd, "--clearenv"]
    base_env = {"PATH": h.bin_path, "HOME": "/home/agent",
                "USER": "agent", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
    for key, value in (base_env | (env or {})).items():
        argv += ["--setenv", key, value]
    return [*argv, "--", *command]


_cpu_lock = threading.Lock()
_cpu = {"seconds": 0.0, "unmeasured": 0}


def sandbox_cpu() -> tuple[float, int]:
    """(CPU seconds used by the sandboxes this process has closed, how many of them could not be measured)."""
    with _cpu_lock:
        return _cpu["seconds"], _cpu["unmeasured"]


class Cgroups:
    """Per-sandbox cgroup (v2, or v1 memory + pids [+ cpuacct]) that the launcher's child joins before exec."""

    def __init__(self, h: Host, limits: Limits):
        self.version = h.cgroup
        self.name = f"shipyard-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # owner pid: see layout.recover_stale
        self.dirs: list[Path] = []
        self.cpu_file: Path | None = None
        try:
            self._create(limits)
        except BaseException:  # a limit the kernel refused: remove what was made, then report
            for d in reversed(self.dirs):
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise

    def _mkdir(self, d: Path) -> Path:
        d.mkdir()
        self.dirs.append(d)
        return d

    def _create(self, limits: Limits) -> None:
        memory, pids = limits.memory_mb * 1024 * 1024, limits.pids
        if self.version == "v2":
            d = self._mkdir(CGROUP_ROOT / self.name)
            (d / "memory.max").write_text(str(memory))
            (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(pids))
            self.cpu_file = d / "cpu.stat"
        elif self.version == "v1":
            mem = self._mkdir(CGROUP_ROOT / "memory" / self.name)
            pid = self._mkdir(CGROUP_ROOT / "pids" / self.name)
            (mem / "memory.limit_in_bytes").write_text(str(memory))
            with contextlib.suppress(OSError):  # absent without swap accounting
                (mem / "memory.memsw.limit_in_bytes").write_text(str(memory))
            (pid / "pids.max").write_text(str(pids))
            acct = CGROUP_ROOT / "cpuacct"
            if (acct / "cpuacct.usage").exists() and os.access(acct, os.W_OK):
                self.cpu_file = self._mkdir(acct / self.name) / "cpuacct.usage"

    def join(self) -> None:
        """Called in the child between fork and exec."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def kill_all(self, wait: float = 5.0) -> None:
        """SIGKILL every process left in the cgroup (whatever session or group it escaped to); wait for none."""
        if not kill_members(self.dirs, wait):
            raise RuntimeError(f"processes in cgroup {self.name} survived SIGKILL for {wait} s")

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) of everything that ran in the cgroup, or None where it is not counted."""
        if self.cpu_file is None:
            return None
        text = self.cpu_file.read_text()
        if self.version == "v2":
            fields = dict(line.split() for line in text.splitlines())
            return int(fields["usage_usec"]) / 1e6
        return int(text) / 1e9

    def remove(self) -> None:
        self.kill_all()
        used = self.cpu_seconds()
        with _cpu_lock:
            if used is None:
                _cpu["unmeasured"] += 1
            else:
                _cpu["seconds"] += used
        for d in self.dirs:
            d.rmdir()


def preexec(h: Host, limits: Limits, cgroups: Cgroups | None):
    """The function run in the child before exec: join cgroups, set rlimits, drop to the sandbox uid."""

    def run() -> None:
        if cgroups is not None:
            cgroups.join()
        mb = 1024 * 1024
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_mb * mb, limits.file_size_mb * mb))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if cgroups is None or not cgroups.dirs:
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.pids, limits.pids))
        if h.drop_privileges:
            os.setgroups([])
            os.setgid(h.gid)
            os.setuid(h.uid)

    return run
