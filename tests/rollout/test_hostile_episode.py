"""Adversarial episodes (review of issue 14): what the model does in its sandbox must end as a scored rollout
or a clear infrastructure failure — never an exception that takes the whole run down, never a masked reward it
chose."""

from __future__ import annotations

import json
from pathlib import Path

from servers import needs_sandbox

from shipyard.models.replay import ReplayEngine
from shipyard.rollout.environment import LocalEnvironment
from shipyard.rollout.episode import episode_config, run_episode
from shipyard.rollout.record import EpisodeSpec, rollout_seed
from shipyard.tasks.taskset import list_tasks

# A daemon (its own session: not a background job, so closing the tool context does not stop it) that waits for
# the episode's final diff and then kills every process of the sandbox uid: the exec session dies in the middle of
# the diff. It watches for the diff's scratch directory (made before the 3,000 files are mirrored into it) or its
# `git diff --no-index`, whichever it sees first, polling until a deadline rather than for a number of rounds: on a
# loaded machine a fixed number of rounds could end before the diff began, and the diff could pass unseen.
KILL_DURING_DIFF = (
    "mkdir -p hostile && for i in $(seq 3000); do echo $i > hostile/f$i; done; "
    "setsid bash -c 'end=$((SECONDS + 600)); while ((SECONDS < end)); do "
    "if compgen -G \"${TMPDIR:-/tmp}/shipyard-diff-*\" >/dev/null; then kill -9 -1; fi; "
    "for p in /proc/[0-9]*/comm; do read -r c < $p 2>/dev/null; if [[ $c == git ]]; then kill -9 -1; fi; done; "
    "done' >/dev/null 2>&1 </dev/null &"
)


def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>\n'


def spec_of(tasks_dir: Path, task_id: str) -> EpisodeSpec:
    return EpisodeSpec(task_id, tasks_dir, f"hostile-{task_id}", 0, rollout_seed(0, task_id, 0))


@needs_sandbox
def test_killing_the_session_during_the_final_diff_is_scored_not_raised(taskset):
    """Before: the diff's `SessionRestarted` (an OSError, the model's doing) escaped `Agent.run` and `run_episode`,
    and the scheduler failed the whole run with it. The model's act is the model's: the episode is graded (0)."""
    tasks_dir, _, _ = taskset
    task_id = list_tasks(tasks_dir)[0]
    engine = ReplayEngine([call("run_terminal", command=KILL_DURING_DIFF), "done"])
    with LocalEnvironment() as env:
        rollout = run_episode(spec_of(tasks_dir, task_id), engine, env, episode_config("random:tiny"))
    assert rollout.reward == 0.0 and not rollout.masked, (rollout.status, rollout.infra_cause)
    assert rollout.stop_reason == "finished" and "SessionRestarted" in rollout.trajectory.meta["diff_error"]
    assert "b/hostile/f1\n" in rollout.trajectory.patch  # taken again over the same files, on the restarted session


@needs_sandbox
def test_a_background_job_lost_to_a_restart_does_not_break_the_episode(taskset):
    """The model starts a background job, then kills its session (restarted: the job is gone). Stopping the
    episode's jobs at the end must not raise out of `run_episode`: the episode is graded."""
    tasks_dir, _, _ = taskset
    task_id = list_tasks(tasks_dir)[0]
    engine = ReplayEngine([call("run_terminal", command="sleep 1000", background=True),
                           call("run_terminal", command="kill -9 -1"), "done"])
    with LocalEnvironment() as env:
        rollout = run_episode(spec_of(tasks_dir, task_id), engine, env, episode_config("random:tiny"))
    assert rollout.status == "graded" and rollout.reward == 0.0, (rollout.status, rollout.infra_cause)
