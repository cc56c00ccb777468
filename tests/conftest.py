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
from shipyard.tasks.synth import SynthConfig, Synthesizer

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


@pytest.fixture(scope="session")
def taskset(tmp_path_factory):
    """(task set directory, synthesis report, the repository it was made from): three tasks, one per tier,
    synthesized from the example repository once per test session (≈ 25 s: the suite runs in sandboxes several
    times). Tests only read it; each test that grades makes its own sandboxes. Modules that use it skip themselves
    where bubblewrap cannot start, so the fixture never runs on such hosts."""
    repo = tmp_path_factory.mktemp("src") / "pocketlib"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__", ".ruff_cache", ".benchmarks"))
    out = tmp_path_factory.mktemp("tasks")
    report = Synthesizer(repo, out, SynthConfig(max_tasks=3), log=lambda m: None).run()
    return out, report, repo


@pytest.fixture
def source_copy():
    """The sandboxes' copy of shipyard's source, made once before episodes start in parallel: two sandboxes starting
    at once in a fresh checkout race to make it (`shipyard.sandbox.sandbox.shipyard_source` has no lock), and the
    loser's rollout is an infra_error — retried and masked, as it should be, but then pass@k is over fewer samples."""
    from shipyard.sandbox.host import host
    from shipyard.sandbox.sandbox import shipyard_source

    return shipyard_source(host())
