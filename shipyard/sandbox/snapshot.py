"""Read-only snapshots that sandboxes overlay: a repository (and its prepared environment) frozen once.

A snapshot is a copy of the source tree (`cp -a --reflink=auto`: free on copy-on-write filesystems) owned by the
sandbox's host uid. Ownership matters: inside the sandbox, files owned by an unmapped uid (host root) appear
as `nobody` and cannot be modified, so overlay copy-up of an edited file would fail. Hard links cannot be used
for the same reason — re-owning them would change the source. The copy is made once per snapshot (per task);
every episode over it then costs only an empty overlay upper dir.
"""

from __future__ import annotations

import os
import shutil
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


def remove_snapshot(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
