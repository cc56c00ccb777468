"""The environment server (`shipyard env-server`): sandboxes over HTTP, for rollout workers and the CLI.

API (JSON):
- `POST /snapshots {"path": DIR, "name"?: ID}` → `{"id"}`: snapshot a directory on the server's host.
- `POST /sandboxes {"snapshot": ID, "limits"?: {...}}` → `{"id", "start_ms"}`: a fresh sandbox over a snapshot.
- `POST /sandboxes/{id}/call {"method", "params", "wait"?}` → the exec session's reply envelope
  (`{"result"}` or `{"error": {"type", "message"}}`): every `Workspace` operation, exactly as `Sandbox` sends it.
- `POST /sandboxes/{id}/snapshot {"name"?: ID}` → `{"id"}`: the sandbox's workspace as it is now, as a new
  snapshot (fork rollouts from a shared prefix, resume a task).
- `DELETE /sandboxes/{id}`, `DELETE /snapshots/{id}`; `GET /metrics`; `GET /health`.

Warm pool: for every snapshot the server keeps `warm_pool` sandboxes started (refilled in the background as they
are taken), so a create that finds one returns in about a millisecond instead of paying bwrap and the session's
start. Pooled sandboxes count towards `max_live`; creates with custom limits always start cold.

Admission control — bursty RL load must be shed, never hang: at most `max_starting` sandboxes start at once
(starting is the CPU-heavy part), at most `max_live` exist, and at most `max_queue` requests wait for a start slot.
Past that the answer is `503` with `Retry-After`, which `EnvClient` honours. Sandboxes idle for `idle_timeout`
seconds are reaped. Shutting the server down closes every sandbox (processes, cgroups, upper dirs) and every
snapshot it made.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
import uuid
from collections import Counter, deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shipyard.harness.workspace import PathError
from shipyard.sandbox.bwrap import Limits
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot


@dataclass
class ServerConfig:
    max_live: int = 256
    max_starting: int = 8
    max_queue: int = 512
    idle_timeout: float = 1800.0
    retry_after: int = 1
    warm_pool: int = 0  # started sandboxes kept ready per snapshot


class SnapshotRequest(BaseModel):
    path: str
    name: str | None = None


class SandboxRequest(BaseModel):
    snapshot: str
    limits: dict[str, int] | None = None


class EpisodeSnapshotRequest(BaseModel):
    name: str | None = None


class CallRequest(BaseModel):
    method: str
    params: dict[str, Any] = {}
    wait: float = 120.0


@dataclass
class Live:
    sandbox: Sandbox
    last_used: float


class Overloaded(Exception):
    pass


class EnvServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.snapshots: dict[str, Path] = {}
        self.live: dict[str, Live] = {}
        self.lock = threading.Lock()
        self.start_slots = threading.BoundedSemaphore(config.max_starting)
        self.waiting = 0
        self.starts = 0
        self.failures: Counter[str] = Counter()
        self.latencies: deque[float] = deque(maxlen=2000)
        self.start_times: deque[float] = deque(maxlen=2000)
        self.pool: dict[str, deque[Sandbox]] = {}
        self.warm_hits = 0
        self.refills: queue.Queue[str | None] = queue.Queue()
        self.refiller = threading.Thread(target=self._refill_loop, name="shipyard-warm-pool", daemon=True)
        self.refiller.start()

    def pooled(self) -> int:
        return sum(len(q) for q in self.pool.values())

    def _refill_loop(self) -> None:
        while (snapshot_id := self.refills.get()) is not None:
            while True:
                with self.lock:
                    snapshot = self.snapshots.get(snapshot_id)
                    full = (snapshot is None or len(self.pool.get(snapshot_id, ())) >= self.config.warm_pool
                            or len(self.live) + self.pooled() + self.waiting >= self.config.max_live)
                if full:
                    break
                try:
                    with self.start_slots:
                        sandbox = Sandbox(snapshot)
                except Exception as e:  # counted and retried on the next request for this snapshot
                    self.failures[f"warm_start:{type(e).__name__}"] += 1
                    break
                with self.lock:
                    if snapshot_id in self.snapshots:
                        self.pool.setdefault(snapshot_id, deque()).append(sandbox)
                        sandbox = None
                if sandbox is not None:
                    sandbox.close()
                    break

    def add_snapshot(self, snapshot_id: str, path: Path) -> None:
        with self.lock:
            self.snapshots[snapshot_id] = path
        if self.config.warm_pool:
            self.refills.put(snapshot_id)

    def remove_snapshot(self, snapshot_id: str) -> Path | None:
        with self.lock:
            path = self.snapshots.pop(snapshot_id, None)
            pooled = list(self.pool.pop(snapshot_id, ()))
        for sandbox in pooled:
            sandbox.close()
        return path

    def create(self, snapshot_id: str, limits: dict[str, int] | None) -> tuple[str, float]:
        snapshot = self.snapshots.get(snapshot_id)
        if snapshot is None:
            raise HTTPException(404, f"no snapshot '{snapshot_id}'; create one with POST /snapshots")
        known = {f.name for f in fields(Limits)}
        if limits and set(limits) - known:
            raise HTTPException(422, f"unknown limits {sorted(set(limits) - known)}; known: {sorted(known)}")
        if not limits:
            with self.lock:
                warm = self.pool.get(snapshot_id)
                sandbox = warm.popleft() if warm else None
                if sandbox is not None:
                    self.live[sandbox.id] = Live(sandbox, time.monotonic())
                    self.starts += 1
                    self.warm_hits += 1
                    self.start_times.append(time.monotonic())
            if sandbox is not None:
                self.refills.put(snapshot_id)
                return sandbox.id, 0.0
        with self.lock:
            if len(self.live) + self.pooled() + self.waiting >= self.config.max_live:
                self.failures["over_capacity"] += 1
                raise Overloaded(f"{len(self.live)} sandboxes live (max {self.config.max_live})")
            if self.waiting >= self.config.max_queue:
                self.failures["queue_full"] += 1
                raise Overloaded(f"{self.waiting} sandbox starts queued (max {self.config.max_queue})")
            self.waiting += 1
        try:
            with self.start_slots:
                start = time.perf_counter()
                try:
                    sandbox = Sandbox(snapshot, Limits(**(limits or {})))
                except Exception as e:
                    self.failures[f"start:{type(e).__name__}"] += 1
                    raise
                ms = (time.perf_counter() - start) * 1000
        finally:
            with self.lock:
                self.waiting -= 1
        with self.lock:
            self.live[sandbox.id] = Live(sandbox, time.monotonic())
            self.starts += 1
            self.latencies.append(ms)
            self.start_times.append(time.monotonic())
        return sandbox.id, ms

    def get(self, sandbox_id: str) -> Live:
        with self.lock:
            live = self.live.get(sandbox_id)
        if live is None:
            raise HTTPException(404, f"no live sandbox '{sandbox_id}' (destroyed, reaped after idling, or never made)")
        live.last_used = time.monotonic()
        return live

    def destroy(self, sandbox_id: str) -> None:
        with self.lock:
            live = self.live.pop(sandbox_id, None)
        if live is None:
            raise HTTPException(404, f"no live sandbox '{sandbox_id}'")
        live.sandbox.close()

    def reap(self) -> int:
        now = time.monotonic()
        with self.lock:
            idle = [k for k, v in self.live.items() if now - v.last_used > self.config.idle_timeout]
            victims = [self.live.pop(k) for k in idle]
        for v in victims:
            v.sandbox.close()
        self.failures["reaped_idle"] += len(victims)
        return len(victims)

    def metrics(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        pick = (lambda q: round(lat[min(len(lat) - 1, round(q * (len(lat) - 1)))], 2)) if lat else (lambda q: None)
        now = time.monotonic()
        recent = sum(1 for t in self.start_times if now - t < 10)
        mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        kb = lambda key: int(mem[key].split()[0])  # noqa: E731
        return {"live": len(self.live), "queued": self.waiting, "starts_total": self.starts,
                "warm_pool": self.pooled(), "warm_hits": self.warm_hits,
                "starts_per_s": round(recent / 10, 2), "start_latency_ms": {"p50": pick(0.5), "p99": pick(0.99)},
                "failures": dict(self.failures), "snapshots": len(self.snapshots),
                "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
                "memory_used_mb": (kb("MemTotal") - kb("MemAvailable")) // 1024,
                "memory_total_mb": kb("MemTotal") // 1024}

    def shutdown(self) -> None:
        self.refills.put(None)
        self.refiller.join(timeout=60)
        with self.lock:
            victims = [v.sandbox for v in self.live.values()] + [sb for q in self.pool.values() for sb in q]
            snapshots = list(self.snapshots.values())
            self.live, self.pool, self.snapshots = {}, {}, {}
        for sandbox in victims:
            sandbox.close()
        for path in snapshots:
            remove_snapshot(path)


def create_app(config: ServerConfig | None = None) -> FastAPI:
    env = EnvServer(config or ServerConfig())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async def reaper() -> None:
            while True:
                await asyncio.sleep(max(1.0, min(60.0, env.config.idle_timeout / 4)))
                await asyncio.to_thread(env.reap)

        task = asyncio.create_task(reaper())
        yield
        task.cancel()
        await asyncio.to_thread(env.shutdown)

    app = FastAPI(title="shipyard environment server", lifespan=lifespan)
    app.state.env = env

    @app.exception_handler(Overloaded)
    async def overloaded(_, exc: Overloaded) -> JSONResponse:
        return JSONResponse(status_code=503, headers={"Retry-After": str(env.config.retry_after)},
                            content={"error": {"type": "Overloaded", "message": f"over capacity: {exc}; retry later"}})

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"error": {"type": "HTTPError",
                                                                             "message": str(exc.detail)}})

    @app.get("/health")
    async def health() -> dict[str, Any]:
        h = host()
        return {"status": "ok", "sandbox_uid": h.uid, "cgroup": h.cgroup, "notes": list(h.notes)}

    @app.get("/metrics")
    async def metrics() -> dict[str, Any]:
        return env.metrics()

    @app.post("/snapshots")
    async def snapshot(req: SnapshotRequest) -> dict[str, str]:
        if not Path(req.path).is_dir():
            raise HTTPException(400, f"{req.path} is not a directory on the server's host")
        snap_id = req.name or uuid.uuid4().hex[:12]
        if snap_id in env.snapshots:
            raise HTTPException(409, f"snapshot '{snap_id}' exists")
        env.add_snapshot(snap_id, await asyncio.to_thread(make_snapshot, req.path, host(), snap_id))
        return {"id": snap_id}

    @app.delete("/snapshots/{snap_id}")
    async def delete_snapshot(snap_id: str) -> dict[str, bool]:
        path = await asyncio.to_thread(env.remove_snapshot, snap_id)
        if path is None:
            raise HTTPException(404, f"no snapshot '{snap_id}'")
        await asyncio.to_thread(remove_snapshot, path)
        return {"deleted": True}

    @app.post("/sandboxes")
    async def create(req: SandboxRequest) -> dict[str, Any]:
        sandbox_id, ms = await asyncio.to_thread(env.create, req.snapshot, req.limits)
        return {"id": sandbox_id, "start_ms": round(ms, 2)}

    @app.post("/sandboxes/{sandbox_id}/call")
    async def call(sandbox_id: str, req: CallRequest) -> dict[str, Any]:
        live = env.get(sandbox_id)
        try:
            result = await asyncio.to_thread(live.sandbox._call, req.method, req.wait, **req.params)
        except PathError as e:
            return {"error": {"type": "PathError", "message": str(e)}}
        except OSError as e:  # SessionRestarted included: the model hears about it like any OS error
            return {"error": {"type": "OSError", "errno": e.errno, "message": str(e)}}
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            return {"error": {"type": "Error", "message": f"{type(e).__name__}: {e}"}}
        return {"result": result}

    @app.post("/sandboxes/{sandbox_id}/snapshot")
    async def save_snapshot(sandbox_id: str, req: EpisodeSnapshotRequest) -> dict[str, str]:
        live = env.get(sandbox_id)
        snap_id = req.name or uuid.uuid4().hex[:12]
        if snap_id in env.snapshots:
            raise HTTPException(409, f"snapshot '{snap_id}' exists")
        env.add_snapshot(snap_id, await asyncio.to_thread(live.sandbox.save_snapshot, snap_id))
        return {"id": snap_id}

    @app.delete("/sandboxes/{sandbox_id}")
    async def destroy(sandbox_id: str) -> dict[str, bool]:
        await asyncio.to_thread(env.destroy, sandbox_id)
        return {"destroyed": True}

    return app
