"""Read-only snapshots that sandboxes overlay: a repository (and its prepared environment) frozen once.

A snapshot is a copy of the source tree (`cp -a --reflink=auto`: free on copy-on-write filesystems) owned by the
sandbox's host uid. Ownership matters: inside the sandbox, files owned by an unmapped uid (host root) appear
as `nobody` and cannot be modified, so overlay copy-up of an edited file would fail. Hard links cannot be used
for the same reason — re-owning them would change the source. The copy is made once per snapshot (per task);
every episode over it then costs only an empty overlay upper dir.

An episode can itself become a snapshot (`snapshot_episode`: continue a task from a checkpointed state, or fork
many rollouts from one prefix). The merged view exists only inside the sandbox, so it is rebuilt on the host from
the overlay's two layers: copy the lower, then apply the upper — overlayfs records a deletion as a whiteout (a 0:0
character device) and a directory replaced wholesale as an opaque directory (`*.overlay.opaque` = "y").
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

from shipyard.sandbox.host import Host


def make_snapshot(source: str | Path, h: Host, name: str | None = None) -> Path:
    source = Path(source).resolve()
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a directory")
    dest = h.state_dir / "snapshots" / (name or uuid.uuid4().hex[:12])
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(partial.parent, 0o755)
    proc = subprocess.run(["cp", "-a", "--reflink=auto", "--no-target-directory", str(source), str(partial)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(f"could not snapshot {source}: {proc.stderr.strip()}")
    if h.drop_privileges:
        subprocess.run(["chown", "-R", "--no-dereference", f"{h.uid}:{h.gid}", str(partial)], check=True)
    os.replace(partial, dest)
    return dest


def snapshot_episode(lower: Path, upper: Path, h: Host, name: str | None = None) -> Path:
    """A new snapshot holding what a sandbox over `lower` sees now (its upper dir applied). Take it between calls:
    files being written meanwhile may be caught half-written."""
    dest = make_snapshot(lower, h, name)
    try:
        _apply_upper(upper, dest)
    except OSError:
        remove_snapshot(dest)
        raise
    return dest


def _opaque(path: Path) -> bool:
    for attr in ("user.overlay.opaque", "trusted.overlay.opaque"):
        try:
            if os.getxattr(path, attr, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    return False


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _apply_upper(upper: Path, dest: Path) -> None:
    for entry in sorted(upper.iterdir()):
        target = dest / entry.name
        st = entry.lstat()
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # whiteout: deleted in the episode
            _remove(target)
            continue
        if stat.S_ISDIR(st.st_mode):
            if target.is_symlink() or (target.exists() and (not target.is_dir() or _opaque(entry))):
                _remove(target)
            target.mkdir(exist_ok=True)
            _apply_upper(entry, target)
            shutil.copystat(entry, target)
            os.chown(target, st.st_uid, st.st_gid)
        else:
            _remove(target)
            shutil.copy2(entry, target, follow_symlinks=False)
            os.lchown(target, st.st_uid, st.st_gid)
        _strip_overlay_attrs(target)


def _strip_overlay_attrs(path: Path) -> None:
    """copystat/copy2 carry xattrs over, overlayfs's own bookkeeping included; a lower layer must not have it."""
    if path.is_symlink():
        return
    for attr in os.listxattr(path):
        if attr.startswith(("user.overlay.", "trusted.overlay.")):
            os.removexattr(path, attr)


def remove_snapshot(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
