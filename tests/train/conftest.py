"""Shared by the trainer tests: trajectories produced by the real agent loop."""

import shutil
from pathlib import Path

import pytest

from shipyard.harness.loop import Agent, LoopConfig
from shipyard.harness.workspace import LocalWorkspace
from shipyard.models.local import LocalEngine
from shipyard.models.replay import ReplayEngine
from shipyard.models.resolve import tiny_model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pocketlib"
SCRIPTS = [
    ['<tool_call>\n{"name": "list_dir", "arguments": {"path": "."}}\n</tool_call>', "Nothing to change."],
    ['<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md", "limit": 5}}\n</tool_call>',
     '<tool_call>\n{"name": "grep", "arguments": {"pattern": "def roman"}}\n</tool_call>', "Done."],
    ["I cannot help with that."],
    ['<tool_call>\n{"name": "glob", "arguments": {"pattern": "*.toml"}}\n</tool_call>', "All good."],
]
CONFIG = LoopConfig(max_turns=3, max_new_tokens=24, overview_entries=0, seed=0)


@pytest.fixture(scope="session")
def episodes(tmp_path_factory):
    """Trajectories from the real agent loop: 4 scripted (replay engine), 2 sampled from the tiny model."""
    repo = tmp_path_factory.mktemp("ws") / "pocketlib"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    ws = LocalWorkspace(repo)
    trajs = [Agent(ReplayEngine(script), ws, CONFIG).run("Explore the repository.") for script in SCRIPTS]
    model, tok = tiny_model(seed=3)
    engine = LocalEngine(model.float(), tok, name="tiny")
    trajs += [Agent(engine, ws, CONFIG).run("Fix the failing test.") for _ in range(2)]
    ws.close()
    return trajs


