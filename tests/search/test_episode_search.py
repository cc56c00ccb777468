"""codebase_search in a sandboxed rollout: the task's index from synthesis, refreshed with the agent's edits."""

from __future__ import annotations

import json

from servers import needs_sandbox

from shipyard.models.replay import ReplayEngine
from shipyard.rollout.environment import LocalEnvironment
from shipyard.rollout.episode import episode_config, run_episode
from shipyard.rollout.record import EpisodeSpec
from shipyard.rollout.scheduler import rollout_seed
from shipyard.search.index import CodeIndex
from shipyard.search.service import TASK_INDEX, shared_embedder, task_index
from shipyard.tasks.taskset import list_tasks, load_task

pytestmark = needs_sandbox


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_synthesis_indexes_every_task_and_a_rollout_searches_it(taskset):
    tasks_dir = taskset[0]
    task_id = list_tasks(tasks_dir)[0]
    task, task_dir = load_task(tasks_dir, task_id)
    assert task_index(task_dir) == task_dir / TASK_INDEX and not (task_dir / "snapshot" / TASK_INDEX).exists()
    index = CodeIndex.open(task_index(task_dir), shared_embedder())
    assert index.live_chunks() > 50 and index.dead_fraction() == 0
    symbol = task.deleted[0].qualname.split(".")[-1]
    engine = ReplayEngine([call("codebase_search", query=symbol),
                           call("write_file", path="pocketlib/added_helper.py",
                                content="def freshly_written_helper():\n    return 42\n")
                           + call("codebase_search", query="freshly_written_helper"), "Done."])
    config = episode_config("replay", max_turns=4, search=True, grade_timeout=300)
    with LocalEnvironment() as env:
        rollout = run_episode(EpisodeSpec(task_id, tasks_dir, "g", 0, rollout_seed(0, task_id, 0)), engine, env,
                              config)
    assert rollout.status != "infra_error", rollout.infra_cause
    traj = rollout.trajectory
    assert "codebase_search" in traj.meta["tools"]
    first, second = traj.turns[0].calls[0], traj.turns[1].calls[1]
    assert first.error is None and task.deleted[0].file in first.output
    assert second.error is None and "pocketlib/added_helper.py" in second.output
    untouched = CodeIndex.open(task_index(task_dir), shared_embedder())  # the episode worked on a private copy
    assert all("freshly_written_helper" not in h.chunk.text for h in untouched.search("freshly_written_helper", 3))
