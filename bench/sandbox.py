"""Sandbox start-up costs on this host.

1. Create → first command: a fresh `Sandbox` (bwrap + overlay + exec session) until its first command returns,
   and a one-shot `run_in_sandbox` (what `shipyard sandbox exec` does), p50/p99 over `--n` sandboxes.
   Target p50 <= 15 ms for a sandbox start.
2. A new workspace over a 100 MB tree of 20,000 small files: overlay (empty upper dir) vs a full copy of the tree.

    shipyard bench sandbox [-- --n 50]
(The 500-sandbox burst through the environment server arrives with the server.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _common import finish, table

from shipyard.sandbox.host import host
from shipyard.sandbox.run import run_in_sandbox
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--tree-mb", type=int, default=100)
    args = ap.parse_args()
    h = host()
    src = Path(tempfile.mkdtemp(prefix="shipyard-bench-"))
    files = args.tree_mb * 200  # source-tree-like: many 5 KB files (100 MB = 20,000 files in 200 directories)
    for i in range(files):
        d = src / f"d{i % 200}"
        d.mkdir(exist_ok=True)
        (d / f"f{i}.py").write_bytes(os.urandom(5 * 1024 // 2).hex().encode())
    snap = make_snapshot(src, h)

    one_shot, session = [], []
    for _ in range(args.n):
        t = time.perf_counter()
        assert run_in_sandbox(snap, ["true"], timeout=30).exit_code == 0
        one_shot.append((time.perf_counter() - t) * 1000)
    for _ in range(max(5, args.n // 2)):
        t = time.perf_counter()
        with Sandbox(snap) as sb:
            assert sb.run(["true"], timeout=30).exit_code == 0
            session.append((time.perf_counter() - t) * 1000)

    overlay, copy = [], []
    for _ in range(5):
        t = time.perf_counter()
        with Sandbox(snap) as sb:
            sb.write_bytes("new.txt", b"x")
            overlay.append((time.perf_counter() - t) * 1000)
        dest = Path(tempfile.mkdtemp()) / "copy"
        t = time.perf_counter()
        shutil.copytree(src, dest)
        copy.append((time.perf_counter() - t) * 1000)
        shutil.rmtree(dest.parent)
    remove_snapshot(snap)
    shutil.rmtree(src)

    table("create → first command (ms)", ["what", "p50", "p99", "n"],
          [["one-shot sandbox (run_in_sandbox: bwrap + cgroup + overlay + `true`)", pct(one_shot, 50),
            pct(one_shot, 99), len(one_shot)],
           ["Sandbox with exec session (incl. Python start inside)", pct(session, 50), pct(session, 99),
            len(session)]])
    table(f"new workspace over a {args.tree_mb} MB tree (ms, median of 5)", ["method", "ms"],
          [["overlay (sandbox start + first write)", statistics.median(overlay)],
           ["full copy (shutil.copytree)", statistics.median(copy)]])
    finish("sandbox", {"one_shot_p50_ms": round(pct(one_shot, 50), 2), "one_shot_p99_ms": round(pct(one_shot, 99), 2),
                       "session_p50_ms": round(pct(session, 50), 2), "session_p99_ms": round(pct(session, 99), 2),
                       "overlay_ms": round(statistics.median(overlay), 1), "copy_ms": round(statistics.median(copy), 1),
                       "tree_mb": args.tree_mb, "target_p50_ms": 15, "cgroup": h.cgroup})


if __name__ == "__main__":
    main()
