"""`EnvServer`: the environment server's state — snapshots, live and warm sandboxes, grades — and its admission.

The HTTP layer (`shipyard.sandbox.server.create_app`) validates a request and hands it here; everything that holds
a sandbox, a snapshot or a thread is decided in this class, under one lock, so capacity is counted in one place.

Threads. Sandbox calls have their own threads — one per live sandbox (`max_live` + a few) plus a shared pool for
parallel calls, at most `max_calls_per_sandbox` each — so one sandbox's long runs cannot take another's. Starts,
copies and control work (destroy, delete, reap) have their own executors; `/health` and `/metrics` run on the loop.

Warm pool: for every snapshot the server keeps `warm_pool` sandboxes started (refilled in the background as they
are taken), so a create that finds one returns in about a millisecond instead of paying bwrap and the session's
start. Pooled sandboxes count towards `max_live`; creates with custom limits always start cold.

Admission control — bursty RL load must be shed, never hang: at most `max_starting` sandboxes start at once
(starting is the CPU-heavy part), at most `max_live` exist, and at most `max_queue` requests wait for a start slot;
at most `max_grading` grades run at once (each on its own thread, off the event loop) and `max_grade_queue` wait.
Past that `Overloaded` is raised, which the app answers with `503` and `Retry-After` (`EnvClient` honours it).
Sandboxes idle for `idle_timeout` seconds (no call in flight) are reaped. `shutdown` closes every sandbox
(processes, cgroups, upper dirs) and every snapshot it made, task snapshots included. A grade still running then is
abandoned: its verdict could blame the patch for sandboxes the shutdown killed, so it is never returned.
"""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import threading
import time
import uuid
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel

from shipyard.sandbox.bwrap import Limits
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.server_config import ServerConfig, check_config
from shipyard.sandbox.snapshot import remove_snapshot
from shipyard.sandbox.task_snapshots import TaskRefused, TaskSnapshots, open_task
from shipyard.tasks.grade import grade
from shipyard.tasks.taskset import TaskFormatError


@dataclass
class Live:
    sandbox: Sandbox
    last_used: float
    slots: asyncio.Semaphore  # calls in flight for this sandbox
    first: asyncio.Lock = field(default_factory=asyncio.Lock)  # holds this sandbox's thread in the calls pool
    busy: int = 0
    release: Any = None  # called once the sandbox is closed (a task sandbox gives back its cached snapshot)

    def close(self) -> None:
        try:
            self.sandbox.close()
        finally:
            if self.release is not None:
                self.release()


class Overloaded(Exception):
    pass


class EnvServer:
    def __init__(self, config: ServerConfig):
        self.roots = check_config(config)
        self.config = config
        self.snapshots: dict[str, Path] = {}
        self.reserved: set[str] = set()  # snapshot names being copied
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
        self.calls = ThreadPoolExecutor(config.max_live + 8, "shipyard-call")
        self.extra_calls = ThreadPoolExecutor(config.extra_call_threads, "shipyard-call-extra")
        self.starter = ThreadPoolExecutor(config.max_starting, "shipyard-start")
        self.copier = ThreadPoolExecutor(config.copy_threads, "shipyard-copy")
        self.control = ThreadPoolExecutor(config.control_threads, "shipyard-control")
        self.refills: queue.Queue[str | None] = queue.Queue()
        self.tasks = TaskSnapshots(host(), config.copy, config.max_task_snapshots, config.max_task_snapshot_bytes)
        self.grade_slots = threading.BoundedSemaphore(config.max_grading)
        self.grades_waiting = self.grading = self.grades = 0
        self.closing = False
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

    def source(self, raw: str) -> Path:
        """The real directory a snapshot request names, if the operator allowed it."""
        if "\x00" in raw:
            raise HTTPException(422, "path must not contain a NUL character")
        if not os.path.isabs(raw):
            raise HTTPException(422, f"path {raw!r} must be absolute (a directory on the server's host)")
        # Judged as written (`..` lexically), never resolved: the copy walks it from the root without following a
        # link (snapshot._open_root), so what is checked here is exactly what is opened there.
        path = Path(os.path.normpath(raw))
        if not any(path.is_relative_to(root) for root in self.roots):
            allowed = ", ".join(map(str, self.roots)) or "none"
            raise HTTPException(403, f"{raw} is outside the directories this server may snapshot (allowed roots: "
                                f"{allowed}, as real paths); the operator allows more with "
                                "`shipyard env-server --allow-root DIR`")
        return path

    def reserve(self, name: str | None) -> str:
        snap_id = name or uuid.uuid4().hex[:12]
        with self.lock:
            if snap_id in self.snapshots or snap_id in self.reserved:
                raise HTTPException(409, f"snapshot '{snap_id}' exists; choose another name or delete it first")
            if len(self.snapshots) + len(self.reserved) >= self.config.max_snapshots:
                raise HTTPException(429, f"{self.config.max_snapshots} snapshots exist (this server's maximum); "
                                    "delete some with DELETE /snapshots/{id}")
            self.reserved.add(snap_id)
        return snap_id

    def add_snapshot(self, snapshot_id: str, path: Path) -> None:
        with self.lock:
            self.reserved.discard(snapshot_id)
            self.snapshots[snapshot_id] = path
        if self.config.warm_pool:
            self.refills.put(snapshot_id)

    def release(self, snapshot_id: str) -> None:
        with self.lock:
            self.reserved.discard(snapshot_id)

    def remove_snapshot(self, snapshot_id: str) -> Path | None:
        with self.lock:
            path = self.snapshots.pop(snapshot_id, None)
            pooled = list(self.pool.pop(snapshot_id, ()))
        for sandbox in pooled:
            sandbox.close()
        if path is not None:
            remove_snapshot(path)
        return path

    def limits(self, req: BaseModel | None) -> Limits | None:
        """The request's limits (defaults for those not given), or None for none; 422 outside the operator's range."""
        given = {k: v for k, v in (req.model_dump() if req else {}).items() if v is not None}
        lo, hi = asdict(self.config.min_limits), asdict(self.config.max_limits)
        bad = [f"limits.{k}: {v} is outside this server's range {lo[k]}..{hi[k]}" for k, v in given.items()
               if not lo[k] <= v <= hi[k]]
        if bad:
            raise HTTPException(422, "invalid request: " + "; ".join(bad))
        return Limits(**given) if given else None

    def admit(self, snapshot_id: str, limits: Limits | None) -> tuple[Path, Live | None]:
        """A warm sandbox if one fits, else a place in the start queue (or Overloaded)."""
        with self.lock:
            snapshot = self.snapshots.get(snapshot_id)
            if snapshot is None:
                raise HTTPException(404, f"no snapshot '{snapshot_id}'; create one with POST /snapshots")
            warm = self.pool.get(snapshot_id) if limits is None else None
            if warm:
                live = self._register(warm.popleft())
                self.warm_hits += 1
                self.refills.put(snapshot_id)
                return snapshot, live
            self._queue_start()
        return snapshot, None

    def _queue_start(self) -> None:
        """Under the lock: a place in the start queue, or Overloaded."""
        if len(self.live) + self.pooled() + self.waiting >= self.config.max_live:
            self.failures["over_capacity"] += 1
            raise Overloaded(f"{len(self.live)} sandboxes live (max {self.config.max_live})")
        if self.waiting >= self.config.max_queue:
            self.failures["queue_full"] += 1
            raise Overloaded(f"{self.waiting} sandbox starts queued (max {self.config.max_queue})")
        self.waiting += 1

    def task_snapshot(self, raw: str) -> tuple[Path, Any]:
        """On a copier thread: the cached snapshot of the task directory `raw` and a queued start over it; the
        second item gives the snapshot back (`start` calls it when the sandbox closes, or fails to start)."""
        with open_task(raw, self.roots, self.tasks.links) as t:
            cached = self.tasks.acquire(t)
        try:
            with self.lock:
                self._queue_start()
        except BaseException:
            self.tasks.release(cached)
            raise
        return cached.path, functools.partial(self.tasks.release, cached)

    def admit_grade(self) -> None:
        with self.lock:
            if self.closing:
                raise Overloaded("the server is shutting down")
            if self.grades_waiting + self.grading >= self.config.max_grading + self.config.max_grade_queue:
                self.failures["grade_queue_full"] += 1
                raise Overloaded(f"{self.grading} grades running and {self.grades_waiting} queued (max "
                                 f"{self.config.max_grading} and {self.config.max_grade_queue})")
            self.grades_waiting += 1

    def grade(self, raw: str, patch: str, timeout: float) -> dict[str, Any]:
        """On a grading thread, after `admit_grade`: the verdict of `patch` on the task directory `raw`, graded in
        a fresh sandbox over the task's cached snapshot."""
        with self.grade_slots:
            with self.lock:
                self.grades_waiting -= 1
                self.grading += 1
            try:
                if self.closing:
                    raise Overloaded("the server is shutting down")
                with open_task(raw, self.roots, self.tasks.links) as t:
                    cached = self.tasks.acquire(t)
                    try:
                        verdict = grade(t.task, t.dir, patch, timeout, snapshot=cached.path)
                    except TaskFormatError as e:
                        raise TaskRefused(400, t.hide(str(e))) from None
                    except Exception as e:  # the grader gives every patch a verdict: this is the server's failure
                        raise HTTPException(500, t.hide(f"grading failed: {type(e).__name__}: {e}")) from None
                    finally:
                        self.tasks.release(cached)
            finally:
                with self.lock:
                    self.grading -= 1
        with self.lock:
            self.grades += 1
            if verdict.status == "infra_error":
                self.failures["grade:infra_error"] += 1
        if self.closing:  # the shutdown may have killed its sandboxes: the verdict proves nothing
            raise Overloaded("the server shut down during grading; grade again")
        return verdict.to_json()

    def _register(self, sandbox: Sandbox) -> Live:
        """Under the lock: a started sandbox becomes live."""
        live = Live(sandbox, time.monotonic(), asyncio.Semaphore(self.config.max_calls_per_sandbox))
        self.live[sandbox.id] = live
        self.starts += 1
        self.start_times.append(time.monotonic())
        return live

    def start(self, snapshot: Path, limits: Limits | None, release=None) -> tuple[str, float]:
        """In a starter thread, after `admit` queued it: start a sandbox."""
        try:
            with self.start_slots:
                start = time.perf_counter()
                try:
                    sandbox = Sandbox(snapshot, limits)
                except Exception as e:
                    if release is not None:
                        release()
                    self.failures[f"start:{type(e).__name__}"] += 1
                    raise HTTPException(500, f"the sandbox could not start ({type(e).__name__}: {e}); the server's "
                                        "host may be out of memory or processes — retry, or check GET /health") from e
                ms = (time.perf_counter() - start) * 1000
        finally:
            with self.lock:
                self.waiting -= 1
        with self.lock:
            self._register(sandbox).release = release
            self.latencies.append(ms)
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
        live.close()

    def reap(self) -> int:
        now = time.monotonic()
        with self.lock:
            idle = [k for k, v in self.live.items() if not v.busy and now - v.last_used > self.config.idle_timeout]
            victims = [self.live.pop(k) for k in idle]
        for v in victims:
            v.close()
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
                "warm_pool": self.pooled(), "warm_hits": self.warm_hits, "grading": self.grading,
                "grades_queued": self.grades_waiting, "grades_total": self.grades, "task_snapshots": self.tasks.stats(),
                "starts_per_s": round(recent / 10, 2), "start_latency_ms": {"p50": pick(0.5), "p99": pick(0.99)},
                "failures": dict(self.failures), "snapshots": len(self.snapshots),
                "calls_in_flight": sum(v.busy for v in list(self.live.values())),
                "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(),
                "memory_used_mb": (kb("MemTotal") - kb("MemAvailable")) // 1024,
                "memory_total_mb": kb("MemTotal") // 1024}

    def shutdown(self) -> None:
        self.closing = True
        self.refills.put(None)
        self.refiller.join(timeout=60)
        with self.lock:
            victims = [*self.live.values()]
            pooled = [sb for q in self.pool.values() for sb in q]
            snapshots = list(self.snapshots.values())
            self.live, self.pool, self.snapshots = {}, {}, {}
        for live in victims:
            live.close()
        for sandbox in pooled:
            sandbox.close()
        for path in snapshots:
            remove_snapshot(path)
        deadline = time.monotonic() + self.config.shutdown_grace
        while self.grading and time.monotonic() < deadline:
            time.sleep(0.05)
        self.tasks.close()
        for pool in (self.calls, self.extra_calls, self.starter, self.copier, self.control):
            pool.shutdown(wait=False, cancel_futures=True)
