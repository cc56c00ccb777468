"""Shared fixtures: a fresh copy of the example repository, workspaces over it, and real servers on 127.0.0.1."""

from __future__ import annotations

import os

# Tests never reach a model hub; huggingface_hub reads this once, at import, so it is set before anything imports it.
os.environ["HF_HUB_OFFLINE"] = "1"

import contextlib
import shutil
from pathlib import Path

import pytest
from servers import running_app

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
    """Start ASGI apps that live for the whole test session (`running_app`); returns a function app -> base URL."""
    with contextlib.ExitStack() as stack:
        yield lambda app: stack.enter_context(running_app(app))
