"""The run directory: a new run refuses to overwrite one, metrics go to JSON lines and TensorBoard, and a resumed
run's logs read as if it had never stopped (later steps dropped, TensorBoard events purged)."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shipyard.rl.rundir import RunDir, RunDirError, flatten


def scalars(run: RunDir, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run.tb_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_new_run_refuses_a_directory_in_use(tmp_path):
    RunDir.create(tmp_path / "run").close()
    with pytest.raises(RunDirError, match="--resume"):
        RunDir.create(tmp_path / "run")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="not empty"):
        RunDir.create(tmp_path / "other")
    with pytest.raises(RunDirError, match="not a shipyard run directory"):
        RunDir.resume(tmp_path / "other", step=0)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_a_new_run_may_start_where_its_task_set_was_just_synthesized(tmp_path):
    """The default task set is RUN/tasks, synthesized before the run directory is made (a fresh `shipyard train`
    once failed on its own task set: "exists and is not empty")."""
    (tmp_path / "run" / "tasks").mkdir(parents=True)
    RunDir.create(tmp_path / "run", keep=[tmp_path / "run" / "tasks"]).close()
    (tmp_path / "other" / "tasks").mkdir(parents=True)
    (tmp_path / "other" / "stray.txt").write_text("x")
    with pytest.raises(RunDirError, match="not empty"):
        RunDir.create(tmp_path / "other", keep=[tmp_path / "other" / "tasks"])


def test_metrics_go_to_json_lines_and_tensorboard(tmp_path):
    with RunDir.create(tmp_path / "run") as run:
        line = run.log(1, {"reward": {"mean": 0.5}, "loss": 1.25, "note": "text", "nan": float("nan"), "ok": True})
        run.log(2, {"reward": {"mean": 0.75}, "loss": 1.0})
    assert line["reward/mean"] == 0.5 and line["note"] == "text" and line["step"] == 1
    assert [m["reward/mean"] for m in run.metrics()] == [0.5, 0.75]
    assert scalars(run, "reward/mean") == [(1, 0.5), (2, 0.75)]
    acc = EventAccumulator(str(run.tb_dir))
    acc.Reload()
    assert "note" not in acc.Tags()["scalars"] and "nan" not in acc.Tags()["scalars"]  # only finite numbers
    assert run.status()["status"] == "running"


def test_a_resumed_run_redoes_the_steps_after_its_checkpoint(tmp_path):
    run = RunDir.create(tmp_path / "run")
    for step in range(1, 6):
        run.log(step, {"loss": float(step)})
        run.log_rollouts([{"step": step, "rollout": f"t@{step}/0"}])
        run.write_trajectories(step, [{"rollout": f"t@{step}/0"}])
    with run.metrics_path.open("a") as f:
        f.write('{"step": 6, "loss": ')  # the crash cut this line short
    run.close()

    resumed = RunDir.resume(tmp_path / "run", step=3)  # the last checkpoint was step 3
    assert [m["step"] for m in resumed.metrics()] == [1, 2, 3]
    assert [json.loads(x)["step"] for x in resumed.rollouts_path.read_text().splitlines()] == [1, 2, 3]
    assert sorted(p.name for p in resumed.trajectories_dir.iterdir()) == [f"step-00000{i}.jsonl" for i in (1, 2, 3)]
    for step in (4, 5):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.set_status("finished", step=5)
    resumed.close()
    assert scalars(resumed, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    status = resumed.status()
    assert status["status"] == "finished" and status["resumed_from"] == 3 and status["step"] == 5


def test_flatten_and_status_validation(tmp_path):
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a/b": 1, "a/c/d": 2, "e": 3}
    # a run keeps every step's line: the same key is one string, not one per step
    assert next(iter(flatten({"a": {"b": 1}}))) is next(iter(flatten({"a": {"b": 2}})))
    run = RunDir.create(tmp_path / "run")
    with pytest.raises(ValueError, match="status must be one of"):
        run.set_status("paused")


def test_a_failed_run_keeps_its_traceback_and_says_failed(tmp_path):
    run = RunDir.create(tmp_path / "run")

    def deep() -> None:
        raise KeyError("where the bug is")

    try:
        deep()
    except KeyError as e:
        run.fail(e, step=4)
    text = run.error_path.read_text()
    assert text.startswith("Traceback (most recent call last)") and "in deep" in text
    assert text.rstrip().endswith("KeyError: 'where the bug is'")
    status = run.status()
    assert status["status"] == "failed" and status["step"] == 4 and status["error"] == "KeyError: 'where the bug is'"
