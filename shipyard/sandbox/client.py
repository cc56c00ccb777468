"""`EnvClient` and `RemoteSandbox`: the environment server from the harness's side.

`RemoteSandbox` is a `Workspace` (through `SessionWorkspace`) whose requests travel over HTTP to the server's
`/sandboxes/{id}/call`, so tools run against a remote sandbox exactly as against a local one. Over-capacity
answers (503) are retried after their `Retry-After` until `retry_for` seconds have passed; connection failures
are retried briefly, then reported as `EnvServerUnreachable` with what to do.

Authentication: every request carries the server's bearer token. The client takes it from its `token` argument,
else `$SHIPYARD_ENV_TOKEN`, else the file `$SHIPYARD_ENV_TOKEN_FILE`, else the file `shipyard env-server --port PORT`
writes by default (`token_file(PORT)`: `$SHIPYARD_HOME/env-server/PORT.token`, `SHIPYARD_HOME` defaulting to
`~/.cache/shipyard`; mode 0600, so only the server's user — and clients running as that user — can read it). One
file per port, so servers on one host never overwrite each other's token. While none is found the client looks
again before each request (a server started next to it writes its file a moment later). A 401 becomes an
`EnvServerError` saying where the token was looked for.

Tasks: `task_sandbox(task_dir)` is a sandbox over the server's cached snapshot of a task directory on the server's
host, and `grade(task_dir, patch, timeout)` the grader's `Verdict`, graded there from that snapshot — so rollout
workers on other machines grade without a copy of the task set. Faults keep their meaning: a malformed task is a
`TaskFormatError` (as grading locally), a verdict with status `infra_error` comes back as a verdict (the grader
decided it), and a server that fails, refuses or cannot be reached is an `EnvServerError`/`EnvServerUnreachable`
(both `InfraError`s: the episode is retried or masked, never scored). A patch the grader would refuse unread (over
`MAX_DIFF_BYTES`, or text no file can hold) is the model's doing, so it gets the grader's `patch_rejected` verdict
here, without a request: the server would refuse it with a 413 that must not become an infrastructure failure.
"""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from shipyard.errors import UserError
from shipyard.httpguard import bearer, loopback_port, read_token
from shipyard.models.bundled import shipyard_home
from shipyard.models.errors import InfraError
from shipyard.sandbox.sandbox import SandboxFailed, SessionWorkspace
from shipyard.tasks.grade import Verdict, unreadable
from shipyard.tasks.taskset import TaskFormatError

TOKEN_ENV = "SHIPYARD_ENV_TOKEN"
TASK_COPY_WAIT = 900.0  # seconds a task request may wait while the server copies the task's snapshot


def token_file(port: int) -> Path:
    """Where `shipyard env-server --port PORT` writes its token unless told otherwise, and where clients look last."""
    return shipyard_home() / "env-server" / f"{port}.token"


def _token_source(given: str | None, default: Path | None) -> str:
    if given:
        return "the token passed to EnvClient"
    if os.environ.get(TOKEN_ENV):
        return f"${TOKEN_ENV}"
    if os.environ.get(f"{TOKEN_ENV}_FILE"):
        return f"${TOKEN_ENV}_FILE ({os.environ[f'{TOKEN_ENV}_FILE']})"
    return str(default) if default else "nowhere (a remote server: set $SHIPYARD_ENV_TOKEN)"


class EnvServerUnreachable(InfraError, ConnectionError, UserError):
    """The environment server did not answer (after the client's retries). Inside a run an infrastructure failure
    (the rollout is masked); where it ends a command, the user's to fix (the URL, the server): one line."""


class EnvServerError(InfraError, RuntimeError):
    """The environment server answered with an error that is not the model's doing (its session died, 5xx, 401)."""


class EnvClient:
    def __init__(self, base_url: str, timeout: float = 60.0, retry_for: float = 120.0, *, token: str | None = None):
        self.base_url = base_url.rstrip("/")
        port = loopback_port(self.base_url)  # a local server's token file is never sent to another host
        self.default_token_file = token_file(port) if port is not None else None
        self.given_token = token
        self.token: str | None = None
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self.retry_for = retry_for
        self._find_token()

    def _find_token(self) -> None:
        """Look for the token (again, while none was found: a server starting next to us writes it a moment later)."""
        self.token = self.given_token or read_token(TOKEN_ENV, self.default_token_file)
        self.token_source = _token_source(self.given_token, self.default_token_file)
        self.http.headers.update(bearer(self.token))

    def _unauthorized(self) -> str:
        default = self.default_token_file or token_file(8100).with_name("PORT.token")
        where = (f"the token from {self.token_source} is not this server's" if self.token else
                 f"no token was found (looked at ${TOKEN_ENV}, ${TOKEN_ENV}_FILE"
                 + (f" and {self.default_token_file})" if self.default_token_file else ")"))
        return (f"{where}: set ${TOKEN_ENV} (or ${TOKEN_ENV}_FILE) to the token the server wrote at start — by "
                f"default to {default} of the user running `shipyard env-server`, or where its --token-file said")

    def request(self, method: str, path: str, json: dict | None = None, timeout: float | None = None,
                content: bytes | None = None) -> Any:
        deadline = time.monotonic() + self.retry_for
        connect_failures = 0
        if not self.token:
            self._find_token()
        while True:
            try:
                resp = self.http.request(method, path, json=json, content=content, timeout=timeout or self.http.timeout,
                                         headers={"Content-Type": "application/json"} if content is not None else None)
            except httpx.TransportError as e:
                connect_failures += 1
                if connect_failures >= 3 or time.monotonic() > deadline:
                    raise EnvServerUnreachable(
                        f"cannot reach the environment server at {self.base_url} ({type(e).__name__}: {e}); start "
                        "one with `shipyard env-server --host 127.0.0.1 --port P` or check the URL") from e
                time.sleep(0.2 * connect_failures)
                continue
            if resp.status_code == 503 and time.monotonic() < deadline:
                time.sleep(float(resp.headers.get("Retry-After", "1")))
                continue
            try:
                body = resp.json()
            except ValueError:
                body = None
            if resp.status_code != 200 or not isinstance(body, dict):
                error = body.get("error") if isinstance(body, dict) else None
                message = error.get("message", resp.text) if isinstance(error, dict) else resp.text[:2000]
                if resp.status_code == 401:
                    message = f"{message}; {self._unauthorized()}"
                if resp.status_code == 400 and isinstance(error, dict) and error.get("type") == "TaskFormatError":
                    raise TaskFormatError(message)
                raise EnvServerError(f"{method} {path} → {resp.status_code}: {message}")
            return body

    def snapshot(self, path: str, name: str | None = None) -> str:
        return self.request("POST", "/snapshots", {"path": path, "name": name})["id"]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.request("DELETE", f"/snapshots/{snapshot_id}")

    def sandbox(self, snapshot_id: str, limits: dict[str, int] | None = None) -> RemoteSandbox:
        body = self.request("POST", "/sandboxes", {"snapshot": snapshot_id, "limits": limits})
        return RemoteSandbox(self, body["id"])

    def task_sandbox(self, task_dir: str | Path, limits: dict[str, int] | None = None) -> RemoteSandbox:
        """A sandbox over the task's snapshot (`task_dir/snapshot` on the server's host, cached there; the first
        request for a task waits for its copy, hence the long timeout)."""
        body = self.request("POST", "/tasks/sandboxes", {"task": str(task_dir), "limits": limits},
                            timeout=TASK_COPY_WAIT)
        return RemoteSandbox(self, body["id"])

    def grade(self, task_dir: str | Path, patch: str, timeout: float = 900.0) -> Verdict:
        """The grader's verdict on `patch` for the task directory `task_dir` on the server's host (a suite
        `timeout` in seconds; the request itself may take several times that: patch, control run, queue)."""
        refused = unreadable(patch)  # the grader's own bounds, checked before sending
        if refused:
            return Verdict(Path(task_dir).name, "graded", 0.0).conclude("patch_rejected", refused)
        data = patch.encode("utf-8", "surrogateescape")
        body = json.dumps({"task": str(task_dir), "patch_b64": base64.b64encode(data).decode(), "timeout": timeout})
        reply = self.request("POST", "/grade", content=body.encode(), timeout=2 * timeout + 900)
        try:
            return Verdict(**reply)
        except TypeError as e:
            raise EnvServerError(f"POST /grade → a reply that is not a verdict ({e})") from None

    def metrics(self) -> dict[str, Any]:
        return self.request("GET", "/metrics")

    def close(self) -> None:
        self.http.close()


class RemoteSandbox(SessionWorkspace):
    def __init__(self, client: EnvClient, sandbox_id: str):
        self.client = client
        self.id = sandbox_id
        self._closed = False

    def _call(self, method: str, wait: float = 120, **params: Any) -> Any:
        if self._closed:
            raise SandboxFailed(f"sandbox {self.id} is closed")
        reply = self.client.request("POST", f"/sandboxes/{self.id}/call",
                                    {"method": method, "params": params, "wait": wait}, timeout=wait + 30)
        return self._unwrap(reply)

    def save_snapshot(self, name: str | None = None) -> str:
        """The workspace as it is now, as a new snapshot on the server; its id."""
        return self.client.request("POST", f"/sandboxes/{self.id}/snapshot", {"name": name})["id"]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.request("DELETE", f"/sandboxes/{self.id}")

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
