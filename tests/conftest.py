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
