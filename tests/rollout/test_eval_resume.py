"""An evaluation that stopped goes on from its journal (`shipyard.rollout.evalrun`): finished rollouts kept, masked
ones and the rest run, a torn last line dropped; journals of other settings, without their settings, or a second
eval appended to a journal are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from servers import needs_sandbox

from shipyard.errors import FileFormatError, UsageError
from shipyard.rollout.episode import episode_config
from shipyard.rollout.evalrun import EvalConfig, finished, run_eval, settings_path
from shipyard.rollout.record import Rollout, rollout_seed


def settings(model="m", seed=0, **episode):
    return {"model": model, "engine": "e", "seed": seed, "tasks_dir": "/tasks", "rollout_time_budget": None,
            "episode": {"grade_timeout": 300.0, "loop": {"max_turns": 8, **episode}}}


def record(task, index, seed=0, reward=1.0):
    return Rollout(task, f"{task}@eval", index, rollout_seed(seed, task, index),
                   "graded" if reward is not None else "infra_error", reward).to_json()


def journal(tmp_path, lines, written=None, tail=""):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + tail)
    settings_path(path).write_text(json.dumps(written or settings()))
    return path


def test_finished_keeps_scored_rollouts_this_eval_would_draw(tmp_path):
    lines = [record("a", 0), record("a", 1, reward=None),  # masked: runs again
             record("a", 1, reward=0.0),  # ... and a later attempt of the same sample is kept
             record("b", 0, seed=7),  # another run seed: not this eval's sample
             record("b", 1), record("b", 2),  # index 2 is past samples = 2
             record("c", 0)]  # a task not evaluated now
    kept = finished(journal(tmp_path, lines), settings(), ["a", "b"], EvalConfig(samples=2))
    assert sorted(kept) == [("a", 0), ("a", 1), ("b", 1)]
    assert kept["a", 1].reward == 0.0


def test_a_torn_last_line_is_cut_and_a_malformed_one_elsewhere_is_an_error(tmp_path):
    path = journal(tmp_path, [record("a", 0)], tail='{"task_id": "a", "gro')
    assert sorted(finished(path, settings(), ["a"], EvalConfig(samples=2))) == [("a", 0)]
    assert path.read_text().endswith("}\n") and path.read_text().count("\n") == 1  # the next append starts a line

    bad = journal(tmp_path, [record("a", 0), {"task_id": "a"}, record("a", 1)])
    with pytest.raises(FileFormatError, match=r"r.jsonl:2: not a rollout record"):
        finished(bad, settings(), ["a"], EvalConfig(samples=2))


def test_a_journal_of_other_settings_or_without_them_is_refused(tmp_path):
    path = journal(tmp_path, [record("a", 0)])
    with pytest.raises(UsageError, match=r"other settings — model: 'm' there, 'other' here"):
        finished(path, settings(model="other"), ["a"], EvalConfig())
    with pytest.raises(UsageError, match=r"episode: .*'max_turns': 8.*'max_turns': 3"):
        finished(path, settings(max_turns=3), ["a"], EvalConfig())
    with pytest.raises(UsageError, match=r"seed: 0 there, 1 here"):  # another run seed: other samples entirely
        finished(path, settings(seed=1), ["a"], EvalConfig(seed=1))
    settings_path(path).write_text("[1, 2]")
    with pytest.raises(UsageError, match=r"is not JSON \(not a JSON object\)"):
        finished(path, settings(), ["a"], EvalConfig())
    settings_path(path).unlink()
    with pytest.raises(UsageError, match=r"not the settings they ran with .* remove it to evaluate from the start"):
        finished(path, settings(), ["a"], EvalConfig())
    settings_path(path).write_text("{not json")
    with pytest.raises(UsageError, match=r"is not JSON"):
        finished(path, settings(), ["a"], EvalConfig())
    assert finished(tmp_path / "none.jsonl", settings(), ["a"], EvalConfig()) == {}  # nothing to resume: a fresh eval


@needs_sandbox
def test_a_resumed_eval_runs_only_what_was_not_finished(tmp_path, taskset, source_copy):
    from shipyard.models.replay import ReplayEngine
    from shipyard.rollout.environment import LocalEnvironment
    from shipyard.tasks.taskset import list_tasks

    tasks_dir, _, _ = taskset
    ids = list_tasks(tasks_dir)[:2]
    episode = episode_config("replay", max_turns=2, grade_timeout=300)
    path, config = tmp_path / "eval.rollouts.jsonl", EvalConfig(samples=2, concurrency=2)

    def run(resume=False, **kw):
        engine = ReplayEngine(["I cannot solve this task."])
        with LocalEnvironment() as env:
            seen = []
            doc = run_eval(engine, env, tasks_dir, ids, episode, config, rollouts_path=path, resume=resume,
                           progress=seen.append, describe={"model": "replay"}, **kw)
        return doc, seen

    whole, _ = run()
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(settings_path(path).read_text())["model"] == "replay"
    with pytest.raises(UsageError, match=r"already holds rollouts: resume that eval"):
        run()  # a second eval is not appended to the first one's journal

    masked = {**json.loads(lines[1]), "status": "infra_error", "reward": None}
    path.write_text(lines[0] + "\n" + json.dumps(masked) + "\n" + lines[2][:40])  # one kept, one masked, one torn
    doc, seen = run(resume=True)
    assert doc["config"]["resumed_rollouts"] == 1 and doc["scheduler"]["started"] == 3
    assert len(seen) == 4  # the progress bar hears the kept one too
    assert [r["rollout"] for r in doc["rollouts"]] == [r["rollout"] for r in whole["rollouts"]]
    assert doc["overall"]["scored"] == 4 and doc["overall"]["pass_at"] == whole["overall"]["pass_at"]
    assert len(path.read_text().splitlines()) == 2 + 3 and all(json.loads(x) for x in path.read_text().splitlines())

    with pytest.raises(UsageError, match=r"other settings — episode"):
        episode = replace(episode, grade_timeout=100.0)
        run(resume=True)


def test_cli_resume_needs_the_rollouts_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shipyard.cli", "eval", "--tasks", str(tmp_path), "--model",
                           "replay:gold", "--resume"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--resume continues the eval journalled in --rollouts FILE" in proc.stderr


def test_a_journal_another_eval_is_still_writing_is_refused(tmp_path):
    import fcntl

    path = tmp_path / "r.jsonl"
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # an orphaned eval of the same journal, still running
        with pytest.raises(UsageError, match="being written by another eval that is still running"):
            run_eval(None, None, tmp_path, ["a"], episode_config("replay"), EvalConfig(), rollouts_path=path,
                     resume=True)
