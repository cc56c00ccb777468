"""Shared fixtures: a fresh copy of the example repository, and workspaces over it."""

from __future__ import annotations

import os

# Tests never reach a model hub; huggingface_hub reads this once, at import, so it is set before anything imports it.
os.environ["HF_HUB_OFFLINE"] = "1"

import shutil
from pathlib import Path

import pytest

from shipyard.harness.workspace import LocalWorkspace

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "pocketlib"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    dest = tmp_path / "pocketlib"
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    return dest


@pytest.fixture
def workspace(repo: Path):
    ws = LocalWorkspace(repo)
    yield ws
    ws.close()


@pytest.fixture(scope="session")
def serve_app():
    """Start an ASGI app on a real uvicorn server on 127.0.0.1 (in a thread); returns its base URL. Every server
    started this way stops at the end of the session."""
    import socket
    import threading
    import time

    import uvicorn

    running = []

    def start(app) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        running.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=10)
