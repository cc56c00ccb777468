"""Sandbox start-up costs on this host.

1. Create → first command: a fresh `Sandbox` (bwrap + overlay + exec session) until its first command returns,
   and a one-shot `run_in_sandbox` (what `shipyard sandbox exec` does), p50/p99 over `--n` sandboxes.
   Target p50 <= 15 ms for a sandbox start.
2. A new workspace over a 100 MB tree of 20,000 small files: overlay (empty upper dir) vs a full copy of the tree.

    shipyard bench sandbox [-- --n 50]
3. `shipyard sandbox exec -- true` as a whole process (what a user waits for), next to the cost of importing torch and
   transformers, which commands that use no model must not pay.
4. Burst: `--burst` sandboxes (create → `true` → destroy) at concurrency `--concurrency` through a real
   `shipyard env-server` process on 127.0.0.1; failures seen by clients, then what the server's sandboxes left on
   the host after it stopped (cgroups, sandbox dirs, mounts, bwrap processes: `layout.leftovers(server pid)`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shipyard.bench._common import finish, table
from shipyard.httpguard import new_token
from shipyard.sandbox.client import EnvClient
from shipyard.sandbox.host import host
from shipyard.sandbox.layout import leftovers
from shipyard.sandbox.run import run_in_sandbox
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import snapshot_of


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--tree-mb", type=int, default=100)
    ap.add_argument("--burst", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    h = host()
    src = Path(tempfile.mkdtemp(prefix="shipyard-bench-"))
    files = args.tree_mb * 200  # source-tree-like: many 5 KB files (100 MB = 20,000 files in 200 directories)
    for i in range(files):
        d = src / f"d{i % 200}"
        d.mkdir(exist_ok=True)
        (d / f"f{i}.py").write_bytes(os.urandom(5 * 1024 // 2).hex().encode())
    with snapshot_of(src, h) as snap:
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
    cli, heavy = cli_start(max(5, args.n // 5))
    warm = warm_latency(args.n)
    burst = run_burst(args.burst, args.concurrency)
    shutil.rmtree(src)

    table("create → first command (ms)", ["what", "p50", "p99", "n"],
          [["one-shot sandbox (run_in_sandbox: bwrap + cgroup + overlay + `true`)", pct(one_shot, 50),
            pct(one_shot, 99), len(one_shot)],
           ["Sandbox with exec session (incl. Python start inside)", pct(session, 50), pct(session, 99),
            len(session)],
           ["env-server warm pool: HTTP create + HTTP `true` (pool not empty)", pct(warm, 50), pct(warm, 99),
            len(warm)]])
    table("`shipyard sandbox exec --repo SMALL -- true`, a whole process (ms)", ["what", "p50", "p99", "n"],
          [["the command (imports no torch/transformers)", pct(cli, 50), pct(cli, 99), len(cli)],
           ["for scale: `python -c 'import torch, transformers'`", pct(heavy, 50), pct(heavy, 99), len(heavy)]])
    table(f"new workspace over a {args.tree_mb} MB tree (ms, median of 5)", ["method", "ms"],
          [["overlay (sandbox start + first write)", statistics.median(overlay)],
           ["full copy (shutil.copytree)", statistics.median(copy)]])
    table(f"burst: {args.burst} sandboxes at concurrency {args.concurrency} through shipyard env-server",
          ["what", "value"], [[k, v] for k, v in burst.items()])
    finish("sandbox", {"burst": burst,
                       "one_shot_p50_ms": round(pct(one_shot, 50), 2), "one_shot_p99_ms": round(pct(one_shot, 99), 2),
                       "session_p50_ms": round(pct(session, 50), 2), "session_p99_ms": round(pct(session, 99), 2),
                       "warm_pool_p50_ms": round(pct(warm, 50), 2), "warm_pool_p99_ms": round(pct(warm, 99), 2),
                       "overlay_ms": round(statistics.median(overlay), 1), "copy_ms": round(statistics.median(copy), 1),
                       "cli_exec_p50_ms": round(pct(cli, 50), 1), "import_torch_transformers_ms": round(pct(heavy, 50)),
                       "tree_mb": args.tree_mb, "target_p50_ms": 15, "cgroup": h.cgroup})


def cli_start(n: int) -> tuple[list[float], list[float]]:
    """Wall time of `shipyard sandbox exec -- true` as a user runs it, and of importing torch + transformers."""
    repo = Path(tempfile.mkdtemp(prefix="shipyard-cli-"))
    (repo / "main.py").write_text("print('hi')\n")

    def timed(argv: list[str]) -> float:
        t = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        return (time.perf_counter() - t) * 1000

    cli = [timed([sys.executable, "-m", "shipyard.cli", "sandbox", "exec", "--repo", str(repo), "--", "true"])
           for _ in range(n)]
    heavy = [timed([sys.executable, "-c", "import torch, transformers"]) for _ in range(3)]
    shutil.rmtree(repo)
    return cli, heavy


def start_server(root: Path, *flags: str) -> tuple[subprocess.Popen, EnvClient]:
    """A real `shipyard env-server` process that may snapshot directories under `root`, and a client with its token."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = new_token()
    server = subprocess.Popen([sys.executable, "-m", "shipyard.cli", "env-server", "--port", str(port),
                               "--allow-root", str(root), *flags], env={**os.environ, "SHIPYARD_ENV_TOKEN": token},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = EnvClient(f"http://127.0.0.1:{port}", retry_for=300, token=token)
    for _ in range(300):
        try:
            client.request("GET", "/health")
            break
        except Exception:
            time.sleep(0.1)
    return server, client


def warm_latency(n: int) -> list[float]:
    """Create → first command through the server's HTTP API while the warm pool has a sandbox ready (ms)."""
    repo = Path(tempfile.mkdtemp(prefix="shipyard-warm-"))
    server, client = start_server(repo, "--warm-pool", "2")
    snap = client.snapshot(str(repo))
    samples = []
    for _ in range(n):
        while client.metrics()["warm_pool"] < 1:
            time.sleep(0.02)
        t = time.perf_counter()
        sb = client.sandbox(snap)
        assert sb.run(["true"], timeout=30).exit_code == 0
        samples.append((time.perf_counter() - t) * 1000)
        sb.close()
    client.delete_snapshot(snap)
    server.terminate()
    server.wait(timeout=120)
    shutil.rmtree(repo)
    return samples


def run_burst(n: int, concurrency: int) -> dict:
    repo = Path(tempfile.mkdtemp(prefix="shipyard-burst-"))
    server, client = start_server(repo, "--max-live", str(concurrency), "--max-starting", "4")
    (repo / "main.py").write_text("print('hi')\n")
    snap = client.snapshot(str(repo))
    failures: list[str] = []

    def one(i: int) -> float:
        t = time.perf_counter()
        try:
            with client.sandbox(snap) as sb:
                r = sb.run(["python", "main.py"], timeout=60)
                if r.exit_code != 0 or b"hi" not in r.output:
                    failures.append(f"#{i}: exit {r.exit_code}")
        except Exception as e:
            failures.append(f"#{i}: {type(e).__name__}: {e}")
        return time.perf_counter() - t

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        durations = list(pool.map(one, range(n)))
    wall = time.perf_counter() - start
    metrics = client.metrics()
    client.delete_snapshot(snap)
    server.terminate()
    server.wait(timeout=120)
    shutil.rmtree(repo)
    for _ in range(100):  # processes outside a cgroup die asynchronously after their namespace's init
        if not (left := leftovers(server.pid)):
            break
        time.sleep(0.05)
    return {"sandboxes": n, "failures": len(failures), "first_failures": failures[:3], "wall_s": round(wall, 1),
            "sandboxes_per_s": round(n / wall, 1), "episode_p50_ms": round(pct(durations, 50) * 1000),
            "episode_p99_ms": round(pct(durations, 99) * 1000),
            "server_start_p50_ms": metrics["start_latency_ms"]["p50"],
            "server_start_p99_ms": metrics["start_latency_ms"]["p99"],
            "rejected_503_then_retried": metrics["failures"].get("over_capacity", 0),
            "left_behind": len(left), "first_left_behind": left[:3]}


if __name__ == "__main__":
    main()
