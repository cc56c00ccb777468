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
410 (a sandbox that could not restart: gone), 429 (too many snapshots), 503 + `Retry-After` (over capacity, or
shutting down).

Security model (docs/security.md). The server acts with its operator's privileges (often root) and any local user
can reach its port, so a client must prove the token, and the token buys only what the operator allowed:
* A bearer token (`shipyard.httpguard`), generated at start unless given, in a 0600 file `EnvClient` reads.
* A snapshot source must resolve under `allowed_roots` (checked again on the opened directory); the copy never
  follows a link, is bounded, and refuses special files and links out of the tree (`shipyard.sandbox.snapshot`).
  Names and ids are one path component (`check_name`), never paths.
* One pydantic schema per body (unknown keys rejected), at most `max_body` bytes; limits within the operator's
  `min_limits`..`max_limits`.
* Sandbox calls, starts, copies and control work run on executors of their own (`shipyard.sandbox.admission`), so
  one sandbox's long runs cannot take another's; `/health` and `/metrics` run on the loop.

Modules: `shipyard.sandbox.server_config` (the operator's `ServerConfig` and the request schemas),
`shipyard.sandbox.admission` (`EnvServer`: state, warm pool, admission control, grading, shutdown); this module is
the HTTP layer. Past capacity the answer is `503` with `Retry-After`, which `EnvClient` honours. A grade still running
at shutdown is abandoned: the client sees the connection close, an `EnvServerUnreachable`, or a 503, and its thread,
a daemon, does not hold the process.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse

from shipyard import httpguard
from shipyard.harness.diff import MAX_DIFF_BYTES
from shipyard.harness.workspace import PathError
from shipyard.sandbox.admission import EnvServer, Live, Overloaded
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import SandboxFailed
from shipyard.sandbox.server_config import (
    MAX_PATCH_B64,
    MAX_WAIT,
    CallRequest,
    EpisodeSnapshotRequest,
    GradeRequest,
    SandboxId,
    SandboxRequest,
    ServerConfig,
    SnapshotId,
    SnapshotRequest,
    TaskSandboxRequest,
)
from shipyard.sandbox.snapshot import SnapshotRefused, make_snapshot, snapshot_episode
from shipyard.sandbox.task_snapshots import TaskRefused

__all__ = ["MAX_PATCH_B64", "MAX_WAIT", "EnvServer", "Live", "Overloaded", "ServerConfig", "create_app"]


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
        except SandboxFailed as e:  # it cannot restart: an EnvServerError at the client, not a tool error
            raise HTTPException(410, f"sandbox {sandbox_id} is gone: {e}") from None
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
