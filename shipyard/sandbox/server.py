"""The environment server (`shipyard env-server`): sandboxes over HTTP, for rollout workers and the CLI.

API (JSON; every endpoint but `/health` needs `Authorization: Bearer TOKEN`):
- `POST /snapshots {"path": DIR, "name"?: ID}` → `{"id"}`: snapshot a directory on the server's host that lies under
  one of the roots the operator allowed.
- `POST /sandboxes {"snapshot": ID, "limits"?: {...}}` → `{"id", "start_ms"}`: a fresh sandbox over a snapshot.
- `POST /sandboxes/{id}/call {"method", "params", "wait"?}` → the exec session's reply envelope
  (`{"result"}` or `{"error": {"type", "message"}}`): every `Workspace` operation, exactly as `Sandbox` sends it.
- `POST /sandboxes/{id}/snapshot {"name"?: ID}` → `{"id"}`: the sandbox's workspace as it is now, as a new
  snapshot (fork rollouts from a shared prefix, resume a task).
- `DELETE /sandboxes/{id}`, `DELETE /snapshots/{id}`; `GET /metrics`; `GET /health`.
- Tasks (a task directory of a task set on the server's host, under an allowed root; `shipyard.sandbox.task_snapshots`):
  `POST /tasks/sandboxes {"task": DIR, "limits"?}` → `{"id", "start_ms"}`: a sandbox over the task's snapshot;
  `POST /grade {"task": DIR, "patch_b64", "timeout"}` → the grader's `Verdict` as JSON. Both use one snapshot per task,
  copied by the first request and cached (no copy per call). The patch travels as base64 of its bytes (UTF-8 with
  surrogate escapes, as `tree_diff` writes undecodable bytes), so the server grades exactly the string the client
  holds; over `MAX_DIFF_BYTES` it is refused (413) before the task is even opened.
Errors are `{"error": {"type", "message"}}`: 400 (a malformed task: type `TaskFormatError`), 401, 403 (outside the
allowed roots, or through a link), 404, 409 (name taken), 413, 422 (the reason: a body, name, limit or tree refused),
429 (too many snapshots), 503 + `Retry-After` (over capacity, or shutting down).

Security model (docs/security.md). The server acts with its operator's privileges (often root) and any local user
can reach its port, so a client must prove the token, and the token buys only what the operator allowed:
* A bearer token (`shipyard.httpguard`), generated at start unless given, in a 0600 file `EnvClient` reads.
* A snapshot source must resolve under `allowed_roots` (checked again on the opened directory); the copy never
  follows a link, is bounded, and refuses special files and links out of the tree (`shipyard.sandbox.snapshot`).
  Names and ids are one path component (`check_name`), never paths.
* One pydantic schema per body (unknown keys rejected), at most `max_body` bytes; limits within the operator's
  `min_limits`..`max_limits`.
* Sandbox calls have their own threads — one per live sandbox (`max_live` + a few) plus a shared pool for parallel
  calls, at most `max_calls_per_sandbox` each — so one sandbox's long runs cannot take another's. Starts, copies
  and control work (destroy, delete, reap) have their own executors; `/health` and `/metrics` run on the loop.

Warm pool: for every snapshot the server keeps `warm_pool` sandboxes started (refilled in the background as they
are taken), so a create that finds one returns in about a millisecond instead of paying bwrap and the session's
start. Pooled sandboxes count towards `max_live`; creates with custom limits always start cold.

Admission control — bursty RL load must be shed, never hang: at most `max_starting` sandboxes start at once
(starting is the CPU-heavy part), at most `max_live` exist, and at most `max_queue` requests wait for a start slot;
at most `max_grading` grades run at once (each on its own thread, off the event loop) and `max_grade_queue` wait.
Past that the answer is `503` with `Retry-After`, which `EnvClient` honours. Sandboxes idle for `idle_timeout`
seconds (no call in flight) are reaped. Shutting the server down closes every sandbox (processes, cgroups, upper
dirs) and every snapshot it made, task snapshots included. A grade still running then is abandoned: its
verdict could blame the patch for sandboxes the shutdown killed, so it is never sent (the client sees the connection
close, an `EnvServerUnreachable`, or a 503) and its thread, a daemon, does not hold the process.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import os
import queue
import threading
import time
import uuid
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, create_model

from shipyard import httpguard
from shipyard.harness.diff import MAX_DIFF_BYTES
from shipyard.harness.workspace import PathError
from shipyard.sandbox.bwrap import Limits
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import (
    CopyBounds,
    SnapshotRefused,
    check_name,
    make_snapshot,
    remove_snapshot,
    snapshot_episode,
)
from shipyard.sandbox.task_snapshots import TaskRefused, TaskSnapshots, open_task
from shipyard.tasks.grade import grade
from shipyard.tasks.taskset import TaskFormatError

MAX_WAIT = 86400.0  # the longest a call may wait for its reply (seconds)
MAX_PATCH_B64 = 4 * -(-MAX_DIFF_BYTES // 3)  # base64 characters of the largest patch the grader reads


@dataclass
class ServerConfig:
    token: str = ""  # the bearer token clients send (httpguard.new_token()); required
    allowed_roots: tuple[Path, ...] = ()  # snapshot sources must lie under one of these (none by default)
    token_file: Path | None = None  # where clients on this host find the token (named in errors; the CLI writes it)
    max_live: int = 256
    max_starting: int = 8
    max_queue: int = 512
    idle_timeout: float = 1800.0
    retry_after: int = 1
    warm_pool: int = 0  # started sandboxes kept ready per snapshot
    max_snapshots: int = 256  # snapshots held (or being copied) at once
    max_body: int = 64 << 20  # bytes in one request body (a `write_bytes` call carries its file, base64)
    copy: CopyBounds = field(default_factory=CopyBounds)  # every snapshot copy; outward links refused by default
    min_limits: Limits = field(default_factory=lambda: Limits(memory_mb=64, pids=64, cpu_seconds=1, file_size_mb=1,
                                                              open_files=64, disk_mb=1))
    max_limits: Limits = field(default_factory=lambda: Limits(memory_mb=65536, pids=4096, cpu_seconds=86400,
                                                              file_size_mb=16384, open_files=65536, disk_mb=65536))
    max_calls_per_sandbox: int = 8  # calls of one sandbox in flight at once; more wait their turn
    extra_call_threads: int = 32  # threads shared by sandboxes' second and later parallel calls
    control_threads: int = 8  # destroy, delete, reap
    copy_threads: int = 2  # snapshot copies at once
    max_grading: int = 4  # grades running at once (each runs a test suite in a sandbox)
    max_grade_queue: int = 64  # grades waiting for a slot; beyond: 503
    max_grade_timeout: float = 7200.0  # the longest test-suite timeout a client may ask for (seconds)
    max_task_snapshots: int = 64  # task snapshots cached (least recently used removed first)
    max_task_snapshot_bytes: int = 32 << 30  # their bytes together
    shutdown_grace: float = 5.0  # seconds shutdown waits for running grades before removing their snapshots


def _check_config(config: ServerConfig) -> tuple[Path, ...]:
    """The allowed roots as real paths; ValueError for a config the server must not run with."""
    if len(config.token or "") < 16:
        raise ValueError("the environment server needs a bearer token of at least 16 characters "
                         "(ServerConfig.token; shipyard.httpguard.new_token() makes one)")
    roots = []
    for root in config.allowed_roots:
        real = Path(os.path.realpath(root))
        if not real.is_dir():
            raise ValueError(f"allowed root {root} is not a directory")
        for own, what in ((host().state_dir, "the sandbox state directory"), (config.token_file, "its token file")):
            if own is not None and Path(os.path.realpath(own)).is_relative_to(real):
                raise ValueError(f"allowed root {root} contains {what} ({own}): clients could snapshot the server's "
                                 "own secrets and other clients' sandboxes; allow a narrower directory")
        roots.append(real)
    return tuple(roots)


Name = Annotated[str, AfterValidator(check_name)]
SandboxId = Annotated[str, AfterValidator(functools.partial(check_name, what="sandbox id"))]
SnapshotId = Annotated[str, AfterValidator(functools.partial(check_name, what="snapshot id"))]
Strict = ConfigDict(extra="forbid")  # request bodies: one schema each, unknown keys rejected
PositiveInt = Annotated[StrictInt, Field(ge=1)]

LimitsRequest = create_model("LimitsRequest", __config__=Strict,
                             **{f.name: (PositiveInt | None, None) for f in fields(Limits)})


class SnapshotRequest(BaseModel):
    model_config = Strict
    path: str = Field(min_length=1, max_length=4096)
    name: Name | None = None


class SandboxRequest(BaseModel):
    model_config = Strict
    snapshot: SnapshotId
    limits: LimitsRequest | None = None


class EpisodeSnapshotRequest(BaseModel):
    model_config = Strict
    name: Name | None = None


class CallRequest(BaseModel):
    model_config = Strict
    method: str = Field(min_length=1, max_length=64)
    params: dict[str, Any] = {}
    wait: float = Field(120.0, gt=0, le=MAX_WAIT, allow_inf_nan=False)


TaskPath = Annotated[str, Field(min_length=1, max_length=4096)]


class TaskSandboxRequest(BaseModel):
    model_config = Strict
    task: TaskPath
    limits: LimitsRequest | None = None


class GradeRequest(BaseModel):
    model_config = Strict
    task: TaskPath
    patch_b64: str  # bounded by the body limit of /grade, then decoded and counted before anything else
    timeout: float = Field(900.0, gt=0, allow_inf_nan=False)


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
        self.roots = _check_config(config)
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


def create_app(config: ServerConfig) -> FastAPI:
    env = EnvServer(config)

    async def run(pool: ThreadPoolExecutor, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    async def off_loop(fn, *args):
        """`fn(*args)` on a daemon thread of its own (a grade: minutes, never holding the process at exit)."""
        done: Future = Future()

        def target() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as e:
                done.set_exception(e)

        threading.Thread(target=target, name="shipyard-grade", daemon=True).start()
        return await asyncio.wrap_future(done)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        async def reaper() -> None:
            while True:
                await asyncio.sleep(max(1.0, min(60.0, env.config.idle_timeout / 4)))
                await run(env.control, env.reap)

        task = asyncio.create_task(reaper())
        yield
        task.cancel()
        env.closing = True
        await asyncio.to_thread(env.shutdown)

    app = FastAPI(title="shipyard environment server", lifespan=lifespan)
    app.state.env = env
    httpguard.install(app, token=config.token, max_body=config.max_body,
                      path_max_body={"/grade": MAX_PATCH_B64 + (64 << 10)})

    @app.exception_handler(Overloaded)
    async def overloaded(_, exc: Overloaded) -> JSONResponse:
        return httpguard.error_response(503, "Overloaded", f"over capacity: {exc}; retry later",
                                        {"Retry-After": str(config.retry_after)})

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException) -> JSONResponse:
        kind = "InvalidRequest" if exc.status_code == 422 else "HTTPError"
        return httpguard.error_response(exc.status_code, kind, str(exc.detail))

    @app.exception_handler(TaskRefused)
    async def task_refused(_, exc: TaskRefused) -> JSONResponse:
        kind = {400: "TaskFormatError", 503: "Overloaded"}.get(exc.status, "TaskRefused")
        headers = {"Retry-After": str(config.retry_after)} if exc.status == 503 else None
        return httpguard.error_response(exc.status, kind, str(exc), headers)

    @app.exception_handler(SnapshotRefused)
    async def refused(_, exc: SnapshotRefused) -> JSONResponse:
        return httpguard.error_response(422, "SnapshotRefused", str(exc))

    @app.exception_handler(Exception)
    async def internal(_, exc: Exception) -> JSONResponse:
        return httpguard.error_response(500, "InternalError", f"the server failed: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        h = host()
        return {"status": "ok", "sandbox_uid": h.uid, "cgroup": h.cgroup, "notes": list(h.notes)}

    @app.get("/metrics")
    async def metrics() -> dict[str, Any]:
        return env.metrics()

    async def new_snapshot(name: str | None, make, *args, **kwargs) -> dict[str, str]:
        """Reserve the name, copy on a copier thread (`make(*args, name, **kwargs)`), register the snapshot."""
        snap_id = env.reserve(name)
        try:
            path = await run(env.copier, make, *args, snap_id, **kwargs)
        except BaseException as e:
            env.release(snap_id)
            if isinstance(e, PermissionError):  # the directory changed between the check and the copy
                raise HTTPException(403, str(e)) from None
            if isinstance(e, FileExistsError):  # made by another process sharing the state dir
                raise HTTPException(409, str(e)) from None
            if isinstance(e, OSError):
                raise HTTPException(422, f"cannot snapshot: {e}") from None
            raise
        env.add_snapshot(snap_id, path)
        return {"id": snap_id}

    @app.post("/snapshots")
    async def snapshot(req: SnapshotRequest) -> dict[str, str]:
        return await new_snapshot(req.name, make_snapshot, env.source(req.path), host(), bounds=config.copy,
                                  within=env.roots)

    @app.delete("/snapshots/{snap_id}")
    async def delete_snapshot(snap_id: SnapshotId) -> dict[str, bool]:
        if await run(env.control, env.remove_snapshot, snap_id) is None:
            raise HTTPException(404, f"no snapshot '{snap_id}'")
        return {"deleted": True}

    @app.post("/sandboxes")
    async def create(req: SandboxRequest) -> dict[str, Any]:
        limits = env.limits(req.limits)
        snapshot, warm = env.admit(req.snapshot, limits)
        if warm is not None:
            return {"id": warm.sandbox.id, "start_ms": 0.0}
        sandbox_id, ms = await run(env.starter, env.start, snapshot, limits)
        return {"id": sandbox_id, "start_ms": round(ms, 2)}

    @app.post("/sandboxes/{sandbox_id}/call")
    async def call(sandbox_id: SandboxId, req: CallRequest) -> dict[str, Any]:
        live = env.get(sandbox_id)
        live.busy += 1
        try:
            async with live.slots:
                if not live.first.locked():
                    async with live.first:
                        result = await run(env.calls, live.sandbox._call, req.method, req.wait, **req.params)
                else:
                    result = await run(env.extra_calls, live.sandbox._call, req.method, req.wait, **req.params)
        except PathError as e:
            return {"error": {"type": "PathError", "message": str(e)}}
        except OSError as e:  # SessionRestarted included: the model hears about it like any OS error
            return {"error": {"type": "OSError", "errno": e.errno, "message": str(e)}}
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            return {"error": {"type": "Error", "message": f"{type(e).__name__}: {e}"}}
        finally:
            live.busy -= 1
            live.last_used = time.monotonic()
        return {"result": result}

    @app.post("/sandboxes/{sandbox_id}/snapshot")
    async def save_snapshot(sandbox_id: SandboxId, req: EpisodeSnapshotRequest) -> dict[str, str]:
        sb = env.get(sandbox_id).sandbox
        return await new_snapshot(req.name, snapshot_episode, sb.snapshot, sb.layout.upper, sb.h, bounds=config.copy)

    @app.post("/tasks/sandboxes")
    async def task_sandbox(req: TaskSandboxRequest) -> dict[str, Any]:
        limits = env.limits(req.limits)
        snapshot, release = await run(env.copier, env.task_snapshot, req.task)
        sandbox_id, ms = await run(env.starter, env.start, snapshot, limits, release=release)
        return {"id": sandbox_id, "start_ms": round(ms, 2)}

    @app.post("/grade")
    async def grade_patch(req: GradeRequest) -> dict[str, Any]:
        too_big = f"the patch is larger than {MAX_DIFF_BYTES} bytes (the grader's bound); it is refused unread"
        if len(req.patch_b64) > MAX_PATCH_B64:
            raise HTTPException(413, too_big)
        try:
            data = base64.b64decode(req.patch_b64, validate=True)
        except (binascii.Error, ValueError):
            raise HTTPException(422, "invalid request: patch_b64: not base64 (the patch's UTF-8 bytes, base64)"
                                ) from None
        if len(data) > MAX_DIFF_BYTES:
            raise HTTPException(413, too_big)
        if req.timeout > config.max_grade_timeout:
            raise HTTPException(422, f"invalid request: timeout: {req.timeout:g} s is over this server's maximum of "
                                     f"{config.max_grade_timeout:g} s")
        env.admit_grade()
        return await off_loop(env.grade, req.task, data.decode("utf-8", "surrogateescape"), req.timeout)

    @app.delete("/sandboxes/{sandbox_id}")
    async def destroy(sandbox_id: SandboxId) -> dict[str, bool]:
        await run(env.control, env.destroy, sandbox_id)
        return {"destroyed": True}

    return app
