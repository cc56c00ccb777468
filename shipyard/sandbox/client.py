"""`EnvClient` and `RemoteSandbox`: the environment server from the harness's side.

`RemoteSandbox` is a `Workspace` (through `SessionWorkspace`) whose requests travel over HTTP to the server's
`/sandboxes/{id}/call`, so tools run against a remote sandbox exactly as against a local one. Over-capacity
answers (503) are retried after their `Retry-After` until `retry_for` seconds have passed; connection failures
are retried briefly, then reported as `EnvServerUnreachable` with what to do.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from shipyard.sandbox.sandbox import SessionWorkspace


class EnvServerUnreachable(ConnectionError):
    pass


class EnvServerError(RuntimeError):
    pass


class EnvClient:
    def __init__(self, base_url: str, timeout: float = 60.0, retry_for: float = 120.0):
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self.retry_for = retry_for

    def request(self, method: str, path: str, json: dict | None = None, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + self.retry_for
        connect_failures = 0
        while True:
            try:
                resp = self.http.request(method, path, json=json, timeout=timeout or self.http.timeout)
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
            body = resp.json()
            if resp.status_code != 200:
                message = body.get("error", {}).get("message", resp.text)
                raise EnvServerError(f"{method} {path} → {resp.status_code}: {message}")
            return body

    def snapshot(self, path: str, name: str | None = None) -> str:
        return self.request("POST", "/snapshots", {"path": path, "name": name})["id"]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.request("DELETE", f"/snapshots/{snapshot_id}")

    def sandbox(self, snapshot_id: str, limits: dict[str, int] | None = None) -> RemoteSandbox:
        body = self.request("POST", "/sandboxes", {"snapshot": snapshot_id, "limits": limits})
        return RemoteSandbox(self, body["id"])

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
            raise RuntimeError(f"sandbox {self.id} is closed")
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
