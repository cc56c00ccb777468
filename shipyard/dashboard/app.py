"""`shipyard dashboard`: one page over run directories, eval results, task sets and an environment server's fleet.

    browser ──/#token=T──▶ /, /static/*   index.html, dashboard.js, dashboard.css (no secrets: served to anyone;
                                          no build step, no CDN, no network)
            ──/api/* with Authorization: Bearer T──▶ JSON:
                 runs · runs/R/metrics?offset&file · runs/R/rollouts?filters&page · runs/R/trajectories/S/N
                 runs/R/evals[/E] · compare?a=R/E&b=R/E · runs/R/tasks[/T] · fleet

**Who may look.** A run directory holds everything the model wrote and the code it was trained on, and a loopback
port is open to every local user, so the data is guarded like every shipyard server's (`shipyard.httpguard`): a
token generated at start (or `$SHIPYARD_DASHBOARD_TOKEN`) that every `/api/` request sends as a bearer header. The
printed link carries it in the URL's fragment, which a browser never sends anywhere; the page moves it into
`sessionStorage` (per origin, port included) and out of the address bar. Not a cookie: browsers send a cookie for
127.0.0.1 to every port of it, so any local user's server on another port would receive it. Requests whose Host is
not this server's names are refused (DNS rebinding). Clients name runs, steps, rollouts, evals and tasks; the
server maps only names it listed onto files, never following a link (`shipyard.dashboard.runs`). The page renders
what the model wrote as text, never as markup, and a strict Content-Security-Policy (scripts from this origin only,
no inline script, no eval) backs that up.

**Live.** The page polls: metrics from the byte offset it has read to (only new lines come back), the rollout list,
the fleet's `/metrics` through this server (the environment server's token never reaches the browser).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi import Path as Path_
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from shipyard import httpguard
from shipyard.dashboard.runs import NotFound, Runs, page
from shipyard.httpguard import TokenError
from shipyard.models.errors import InfraError

STATIC = Path(__file__).parent / "static"
TOKEN_ENV = "SHIPYARD_DASHBOARD_TOKEN"
OPEN_PATHS = ("/", "/health", "/static/index.html", "/static/dashboard.js", "/static/dashboard.css")
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # every interface: any Host header is answered
MAX_STEP = 10**9
HEADERS = {"content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                      "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
           "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-store"}


def announce(runs: Path, host: str, port: int, token: str, *, shown_token: bool) -> list[str]:
    """What `shipyard dashboard` prints at start (plain text): what is served where, a note when the interface is
    reachable from other machines, and the link to open — the token in its fragment unless it came from the
    environment (`shown_token` False: the user has it already, and a terminal's scrollback need not)."""
    shown = "127.0.0.1" if host in WILDCARD_HOSTS else f"[{host}]" if ":" in host else host
    lines = [f"dashboard of {runs.resolve()} on http://{shown}:{port}"]
    if not httpguard.is_loopback(host.strip("[]")):
        lines.append(f"note: --host {host} is reachable from other machines, over plain HTTP: the token and every "
                     "page travel unencrypted (put it behind TLS, or keep the default 127.0.0.1)")
    link = f"http://{shown}:{port}/#token="
    lines.append(f"open {link}{token}" if shown_token else f"open {link} followed by the value of ${TOKEN_ENV}")
    return lines


def _eval_ref(runs: Runs, ref: str) -> dict[str, Any]:
    """An eval named "RUN/step-000020"."""
    run, _, name = ref.rpartition("/")
    return runs.get(run).eval(name)


def create_app(runs_dir: Path, *, token: str, env_server: str | None = None, host: str = "127.0.0.1") -> FastAPI:
    """The dashboard over the runs under `runs_dir` (module docstring); `env_server`: the fleet to show; `host`: the
    interface it is served on (with the loopback names, the Host headers it answers; a wildcard answers any)."""
    if len(token) < 16:
        raise TokenError(f"the dashboard needs a token of at least 16 characters (${TOKEN_ENV}): unset it for a "
                         "fresh one")
    runs = Runs(runs_dir)
    app = FastAPI(title="shipyard dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    httpguard.install(app, token=token, max_body=64 << 10, open_paths=OPEN_PATHS)
    hosts = ["*"] if host in WILDCARD_HOSTS else [*LOOPBACK_NAMES, host, f"[{host}]"]
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts)
    fleet_client, fleet_url = None, None
    if env_server is not None:
        from shipyard.sandbox.client import EnvClient

        fleet_client = EnvClient(env_server, timeout=5.0, retry_for=0.0)
        parts = urlsplit(env_server)
        fleet_url = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}"  # no user:password
    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        response = await call_next(request)
        response.headers.update(HEADERS)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return httpguard.error_response(exc.status_code, "HTTPError", str(exc.detail))

    @app.exception_handler(NotFound)
    async def not_found(_: Request, exc: NotFound) -> JSONResponse:
        return httpguard.error_response(404, "NotFound", str(exc))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/api/runs")
    async def list_runs() -> dict[str, Any]:
        return {"root": str(runs.root), "runs": await asyncio.to_thread(runs.list), "fleet": fleet_client is not None}

    @app.get("/api/runs/{run}/metrics")
    async def metrics(run: str, offset: int = Query(0, ge=0), file: str | None = Query(None, max_length=64)
                      ) -> dict[str, Any]:
        return await asyncio.to_thread(lambda: runs.get(run).metrics(offset, file))

    @app.get("/api/runs/{run}/rollouts")
    async def rollouts(run: str, task: str | None = Query(None, max_length=300),
                       step: int | None = Query(None, ge=0, le=MAX_STEP),
                       min_reward: float | None = None, max_reward: float | None = None,
                       flagged: bool | None = None, hinted: bool | None = None,
                       offset: int = Query(0, ge=0), limit: int = Query(50, ge=1, le=500)) -> dict[str, Any]:
        rows = await asyncio.to_thread(lambda: runs.get(run).rollouts())
        out = page(rows, task=task, step=step, min_reward=min_reward, max_reward=max_reward, flagged=flagged,
                   hinted=hinted, offset=offset, limit=limit)
        out["tasks"] = sorted({r["task"] for r in rows if isinstance(r.get("task"), str)})
        out["steps"] = sorted({r["step"] for r in rows})
        return out

    @app.get("/api/runs/{run}/trajectories/{step}/{position}")
    async def trajectory(run: str, step: int = Path_(ge=0, le=MAX_STEP), position: int = Path_(ge=0, le=100_000)
                         ) -> dict[str, Any]:
        return await asyncio.to_thread(lambda: runs.get(run).trajectory(step, position))

    @app.get("/api/runs/{run}/evals")
    async def evals(run: str) -> dict[str, Any]:
        return {"evals": await asyncio.to_thread(lambda: runs.get(run).evals())}

    @app.get("/api/runs/{run}/evals/{name}")
    async def one_eval(run: str, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(lambda: runs.get(run).eval(name))

    @app.get("/api/compare")
    async def compare(a: str = Query(..., max_length=300), b: str = Query(..., max_length=300)) -> dict[str, Any]:
        from shipyard.rollout.eval import compare as compare_evals

        docs = await asyncio.to_thread(lambda: (_eval_ref(runs, a), _eval_ref(runs, b)))
        try:
            return {"refs": {"a": a, "b": b}, **compare_evals(*docs)}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise HTTPException(422, f"these eval results cannot be compared: {type(e).__name__}: {e}") from None

    @app.get("/api/runs/{run}/tasks")
    async def tasks(run: str) -> dict[str, Any]:
        return {"tasks": await asyncio.to_thread(lambda: runs.get(run).tasks())}

    @app.get("/api/runs/{run}/tasks/{task_id}")
    async def task(run: str, task_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(lambda: runs.get(run).task(task_id))

    @app.get("/api/fleet")
    async def fleet() -> dict[str, Any]:
        if fleet_client is None:
            return {"configured": False}
        try:
            metrics = await asyncio.to_thread(fleet_client.metrics)
        except (InfraError, TokenError) as e:  # unreachable, refused, no token: the page says so and keeps polling
            return {"configured": True, "url": fleet_url, "error": f"{type(e).__name__}: {e}"[:500]}
        return {"configured": True, "url": fleet_url, "metrics": metrics}

    app.state.token = token
    return app
