"""Set-up and checks through the Workspace protocol, so one test body serves every kind of workspace."""

from __future__ import annotations


def put(ws, path: str, data: str | bytes) -> None:
    ws.write_bytes(path, data.encode() if isinstance(data, str) else data)


def get(ws, path: str) -> str:
    return ws.read_bytes(path).decode()


def sh(ws, command: str) -> str:
    return ws.run(["bash", "-c", command], timeout=30).output.decode()
