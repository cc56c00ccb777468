"""Per-task base pass rates beside a task set (`shipyard.tasks.baseline`), written from an eval's result document
(fabricated rollouts through `shipyard.rollout.eval.results`, the function `shipyard eval` writes with), and the
curriculum starting from them."""

import json
import random
from collections import Counter

import pytest
from tasksets import write_taskset

from shipyard.errors import UsageError
from shipyard.rollout.eval import results
from shipyard.rollout.record import Rollout
from shipyard.tasks.baseline import SCHEMA, BaselineError, TaskRate, baseline_path, load, model_slug, record
from shipyard.tasks.curriculum import Curriculum, CurriculumConfig, Difficulty


def eval_doc(outcomes: dict[str, list[float | None]], model: str = "qwen2.5-coder-0.5b", ks=(1, 2, 4)) -> dict:
    """An eval result as `shipyard eval --out` writes it: per task, one rollout per reward (None: masked)."""
    groups = {task: [Rollout(task, f"{task}@eval", i, i, "graded" if r is not None else "infra_error", r)
                     for i, r in enumerate(rewards)] for task, rewards in outcomes.items()}
    return json.loads(json.dumps(results(groups, list(ks), config={"model": model, "samples": 4,
                                                                   "task_ids": list(outcomes)}, wall_seconds=1.0)))


def test_an_eval_becomes_per_task_base_rates_beside_the_task_set(tmp_path):
    doc = eval_doc({"t1-a.m-f": [1.0, 0.0, 0.0, 0.0], "t1-a.m-g": [0.0] * 4, "t1-b.m-f": [1.0] * 4,
                    "t1-b.m-g": [None] * 4, "t1-b.m-h": [1.0, None, 0.0, 0.0]})
    path = record(doc, tmp_path)
    assert path == tmp_path / "baseline" / "qwen2.5-coder-0.5b.json" == baseline_path(tmp_path, "qwen2.5-coder-0.5b")
    saved = json.loads(path.read_text())
    assert saved["schema"] == SCHEMA and saved["model"] == "qwen2.5-coder-0.5b" and saved["ks"] == [1, 2, 4]
    assert saved["tasks"]["t1-a.m-f"] == {"samples": 4, "successes": 1, "pass@1": 0.25,
                                         "pass_at": {"1": 0.25, "2": 0.5, "4": 1.0}}
    assert saved["tasks"]["t1-b.m-h"]["samples"] == 3  # masked rollouts are not samples
    assert saved["tasks"]["t1-b.m-h"]["pass_at"] == {"1": pytest.approx(1 / 3), "2": pytest.approx(2 / 3)}
    assert "t1-b.m-g" not in saved["tasks"]  # every sample masked: unknown, not 0
    assert len(saved["evals"]) == 1 and saved["evals"][0]["samples"] == 4 and "task_ids" not in saved["evals"][0]
    assert load(path) == {"t1-a.m-f": TaskRate(4, 1), "t1-a.m-g": TaskRate(4, 0), "t1-b.m-f": TaskRate(4, 4),
                          "t1-b.m-h": TaskRate(3, 1)}
    # A second eval (of other tasks, or again of some) updates the file: its tasks replace those of the same id.
    record(eval_doc({"t1-a.m-g": [1.0, 1.0], "t1-b.m-g": [0.0, 1.0]}, ks=(1, 2)), tmp_path)
    rates = load(path)
    assert rates["t1-a.m-g"] == TaskRate(2, 2) and rates["t1-b.m-g"] == TaskRate(2, 1)
    assert rates["t1-a.m-f"] == TaskRate(4, 1) and len(json.loads(path.read_text())["evals"]) == 2


def test_model_names_become_file_names_and_two_models_never_share_a_file(tmp_path):
    assert model_slug("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b"
    assert model_slug("/runs/sft/export") == "runs-sft-export"
    assert model_slug("openai:http://127.0.0.1:8000/v1") == "openai-http-127.0.0.1-8000-v1"
    for hostile in ("../../etc/passwd", "..", ".", "", "a" * 300, "\n"):
        slug = model_slug(hostile)
        assert 0 < len(slug) <= 64 and "/" not in slug and slug not in (".", "..") and not slug.startswith("."), slug
    record(eval_doc({"t1-a.m-f": [1.0]}, model="runs/x"), tmp_path)
    with pytest.raises(BaselineError, match="baseline of 'runs/x', not of 'runs-x'"):
        record(eval_doc({"t1-a.m-f": [1.0]}, model="runs-x"), tmp_path)


def test_what_is_not_an_eval_result_or_a_baseline_is_one_clear_error(tmp_path):
    for doc in ({}, {"schema": "shipyard.eval/1"}, {"schema": "shipyard.eval-compare/1", "tasks": {}},
                {"schema": "shipyard.eval/1", "tasks": {"t": {"scored": 1, "passed": 2}}, "config": {"model": "m"}},
                {"schema": "shipyard.eval/1", "tasks": {"t": []}, "config": {"model": "m"}}):
        with pytest.raises(BaselineError):
            record(doc | {"config": {"model": "m"}} if "config" not in doc else doc, tmp_path)
    with pytest.raises(UsageError, match="names no model"):
        record({**eval_doc({"t": [1.0]}), "config": {}}, tmp_path)
    path = tmp_path / "b.json"
    for body in ("[", "[]", json.dumps({"schema": SCHEMA, "model": "m", "ks": [], "evals": [],
                                        "tasks": {"t": {"samples": 0, "successes": 0}}}),
                 json.dumps({"schema": SCHEMA, "model": "m", "ks": [], "evals": [],
                             "tasks": {"t": {"samples": 2, "successes": 3}}})):
        path.write_text(body)
        with pytest.raises(BaselineError, match=str(path)):
            load(path)
    with pytest.raises(BaselineError, match="no baseline file"):
        load(tmp_path / "missing.json")


def test_a_result_file_with_fields_of_the_wrong_shape_is_one_clear_error(tmp_path):
    # `record` also reads result files a user kept (`shipyard eval --out`), which may have been edited: every field it
    # reads of the wrong type was an AttributeError or a TypeError, and a boolean count passed as an integer.
    good = eval_doc({"t": [1.0, 0.0]})
    for doc in ({**good, "config": ["m"]}, {**good, "ks": 5},
                {**good, "tasks": {"t": {**good["tasks"]["t"], "pass_at": [1]}}},
                {**good, "tasks": {"t": {**good["tasks"]["t"], "scored": True, "passed": True}}}):
        with pytest.raises((BaselineError, UsageError)):
            record(doc, tmp_path, model="m")
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"schema": SCHEMA, "model": "m", "ks": [], "evals": [],
                                "tasks": {"t": {"samples": True, "successes": 0}}}))
    with pytest.raises(BaselineError, match=str(path)):
        load(path)


def tasks(n: int) -> dict[str, Difficulty]:
    return {f"t{i}": Difficulty(1, 3, 1, 1) for i in range(n)}


def test_the_curriculum_starts_from_the_base_rates():
    base = {"t0": TaskRate(4, 0), "t1": TaskRate(4, 1), "t2": TaskRate(4, 2), "t3": TaskRate(4, 4),
            "elsewhere": TaskRate(4, 2)}
    c = Curriculum(tasks(5), CurriculumConfig(), base)
    assert set(c.tasks) == {"t0", "t1", "t2", "t3", "t4"}  # a baseline adds no task
    assert (c.tasks["t1"].ema, c.tasks["t1"].attempts) == (0.25, 4) and c.tasks["t4"].ema is None
    draws = Counter(c.sample(3000, random.Random(0)))
    assert set(draws) == {"t1", "t2", "t4"}  # never solved (0) and always solved (1) are outside the band
    assert draws["t2"] > draws["t1"]  # p(1 - p): 0.25 at p = 0.5, 0.1875 at 0.25
    # A band drops the tasks outside it from training; tasks the baseline does not cover stay, at the 0.5 prior.
    c = Curriculum(tasks(5), CurriculumConfig(baseline_band=(0.01, 0.99)), base)
    assert set(c.tasks) == {"t1", "t2", "t4"}
    with pytest.raises(UsageError, match="baseline_band"):
        Curriculum(tasks(4), CurriculumConfig(baseline_band=(0.01, 0.99)), {f"t{i}": TaskRate(8, 0) for i in range(4)})
    # Many samples, all passing: retired from the start, as a measured task would be.
    c = Curriculum(tasks(2), CurriculumConfig(), {"t0": TaskRate(16, 16)})
    assert c.tasks["t0"].retired and c.pool() == ["t1"]
    with pytest.raises(ValueError, match="baseline_band"):
        CurriculumConfig(baseline_band=(0.6, 0.4))


def test_the_curriculum_reads_the_baseline_file_of_a_task_set_without_its_held_out_tasks(tmp_path):
    ids = write_taskset(tmp_path / "tasks", {"a": 3, "b": 2})
    path = record(eval_doc({ids["a"][0]: [1.0, 0.0], ids["a"][1]: [0.0, 0.0], ids["b"][0]: [1.0, 0.0]}),
                  tmp_path / "tasks")
    config = CurriculumConfig(baseline=path, baseline_band=(0.01, 0.99))
    c = Curriculum.from_taskset(tmp_path / "tasks", config, exclude=set(ids["b"]))
    assert set(c.tasks) == {ids["a"][0], ids["a"][2]} and c.tasks[ids["a"][0]].ema == 0.5
    other = record(eval_doc({"t1-z.m-f": [1.0]}, model="other"), tmp_path / "tasks")
    with pytest.raises(UsageError, match="covers none of the 3 training tasks"):
        Curriculum.from_taskset(tmp_path / "tasks", CurriculumConfig(baseline=other), exclude=set(ids["b"]))


def test_eval_baseline_needs_an_eval_to_record(tmp_path):
    from typer.testing import CliRunner

    from shipyard.cli import app

    r = CliRunner().invoke(app, ["eval", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--baseline"])
    assert r.exit_code == 2 and "leave out --model, --tasks, --baseline" in r.output, r.output
