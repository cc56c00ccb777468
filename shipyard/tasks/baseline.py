"""Per-task base pass rates of a model, stored beside its task set: `TASKS/baseline/<model-slug>.json`.

**Why.** GRPO-style training learns only from groups whose rewards differ, and the curriculum samples tasks ∝ p(1 −
p) for that reason (`shipyard.tasks.curriculum`). Without a prior every unseen task counts as p = 0.5, so the first
steps spend their rollouts finding out which tasks the starting model never solves (no signal) and which it always
solves (none either). An eval of the starting model, n samples per task, estimates each task's p before training:
the curriculum seeds its pass-rate EMA with it and may keep only the tasks inside a band of base pass@1
(`CurriculumConfig.baseline`, `baseline_band`): it starts where the policy sometimes succeeds. With n samples of
which c pass, pass@1 = c/n and the unbiased pass@k (Chen et al. 2021, `shipyard.rollout.eval.pass_at_k`) is
positive exactly when c > 0, so "pass@k > 0" and "pass@1 ≥ 1/n" keep the same tasks.

**Format** (`SCHEMA`):

    {"schema": "shipyard.baseline/1", "model": NAME, "ks": [1, 2, 4],
     "evals": [{"finished", "tasks", "samples", "seed", "grade_timeout", "loop": {max_turns, …}, …}],
     "tasks": {TASK_ID: {"samples": n, "successes": c, "pass@1": c / n, "pass_at": {"1": …, "4": …}}}}

n counts scored samples (rollouts masked for an infrastructure failure are left out, as in `shipyard eval`); a task
whose every sample was masked is not recorded (its rate is unknown, not 0).

**Written** from an eval's result document (`shipyard eval --tasks T --model M --samples N --baseline`, or `record`
on a result file written by `--out`). The eval's tasks replace those of the same ids in an existing file of the same
model, so a pool's baseline can be built in several evals; `evals` lists the evals the file holds. This module reads
the result document as data and imports nothing of the rollout layer.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shipyard.errors import FileFormatError, UsageError
from shipyard.tasks.taskset import read_capped

SCHEMA = "shipyard.baseline/1"
EVAL_SCHEMA = "shipyard.eval/1"  # shipyard.rollout.eval.SCHEMA, the document `record` reads
MAX_BASELINE = 64 << 20  # bytes of one baseline file


class BaselineError(FileFormatError):
    """A baseline file (or the eval result it is made from) is not what it should be; the message names the file."""


@dataclass(frozen=True)
class TaskRate:
    samples: int  # n, scored samples
    successes: int  # c, samples the grader scored 1


def model_slug(model: str) -> str:
    """The file name of a model's baseline (without `.json`): runs of characters other than letters, digits, `.`, `_`
    and `-` become `-`; past 64 characters, or where nothing is left, a hash of the name ends it."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-._")
    if not slug or len(slug) > 64:
        slug = slug[:55].rstrip("-._") + "-" + hashlib.sha256(model.encode()).hexdigest()[:8]
    return slug.lstrip("-._")


def baseline_path(tasks_dir: Path, model: str) -> Path:
    return Path(tasks_dir) / "baseline" / f"{model_slug(model)}.json"


def rates_of(doc: Mapping[str, Any], where: str = "the eval result") -> dict[str, dict[str, Any]]:
    """Per task of an eval result document (`shipyard eval`'s), what a baseline records of it; tasks with no scored
    sample left out."""
    if not isinstance(doc, Mapping) or doc.get("schema") != EVAL_SCHEMA or not isinstance(doc.get("tasks"), Mapping):
        raise BaselineError(f"{where} is not a shipyard eval result (schema {EVAL_SCHEMA!r} with 'tasks'); write one "
                            "with `shipyard eval --out FILE`")
    if not isinstance(doc.get("config", {}), Mapping) or not isinstance(doc.get("ks", []), list):
        raise BaselineError(f"{where}: its 'config' is not a table or its 'ks' not a list")
    out = {}
    for task_id, summary in doc["tasks"].items():
        n, c = (summary.get("scored"), summary.get("passed")) if isinstance(summary, Mapping) else (None, None)
        if not (_count(n) and _count(c) and c <= n):
            raise BaselineError(f"{where}: task {task_id!r} has no whole 'scored' and 'passed' counts")
        pass_at = summary.get("pass_at") or {}
        if not isinstance(pass_at, Mapping):
            raise BaselineError(f"{where}: task {task_id!r} has a 'pass_at' that is not a table")
        if n:
            out[task_id] = {"samples": n, "successes": c, "pass@1": c / n,
                            "pass_at": {k: v for k, v in pass_at.items() if v is not None}}
    return out


def _count(value: Any) -> bool:
    """A whole count, >= 0 (a JSON `true` is no count, although Python takes it for the integer 1)."""
    return type(value) is int and value >= 0


def record(doc: Mapping[str, Any], tasks_dir: Path, model: str | None = None) -> Path:
    """Write (or update) the baseline of the eval result `doc` beside the task set `tasks_dir`: the file of its model
    (`model`, default the model the eval names); its path."""
    tasks = rates_of(doc)  # checks the document's shape first
    config = doc.get("config") or {}
    model = model or config.get("model")
    if not isinstance(model, str) or not model:
        raise UsageError("the eval result names no model; give the baseline's model name")
    path = baseline_path(tasks_dir, model)
    old = _read(path) if path.exists() else {"schema": SCHEMA, "model": model, "ks": [], "evals": [], "tasks": {}}
    if old["model"] != model:
        raise BaselineError(f"{path} is the baseline of {old['model']!r}, not of {model!r} (two names with one file "
                            "name); record it under another name")
    described = {k: v for k, v in config.items() if k not in ("task_ids", "model")}
    old["evals"].append({"finished": doc.get("finished"), "tasks": len(tasks), **described})
    old["ks"] = sorted(set(old["ks"]) | {k for k in doc.get("ks", []) if isinstance(k, int)})
    old["tasks"] = {**old["tasks"], **tasks}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(old, indent=1) + "\n")
    tmp.replace(path)
    return path


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(read_capped(Path(path), MAX_BASELINE))
    except (ValueError, RecursionError) as e:
        raise BaselineError(f"{path} is not a baseline file: not JSON that can be read ({str(e)[:100]})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("model"), str) \
            or not isinstance(doc.get("tasks"), dict) or not isinstance(doc.get("evals"), list) \
            or not isinstance(doc.get("ks"), list):
        raise BaselineError(f"{path} is not a baseline file (schema {SCHEMA!r} with model, ks, evals and tasks); "
                            "write one with `shipyard eval --baseline`")
    for task_id, rate in doc["tasks"].items():
        n, c = (rate.get("samples"), rate.get("successes")) if isinstance(rate, dict) else (None, None)
        if not (_count(n) and _count(c) and c <= n and n > 0):
            raise BaselineError(f"{path}: task {task_id!r} needs whole 'samples' > 0 and 0 <= 'successes' <= samples")
    return doc


def load(path: Path) -> dict[str, TaskRate]:
    """Task id → its base rate, from the baseline file `path`."""
    if not Path(path).is_file():
        raise BaselineError(f"no baseline file {path}; record one with `shipyard eval --tasks TASKS --model M "
                            "--samples N --baseline`")
    return {t: TaskRate(r["samples"], r["successes"]) for t, r in _read(path)["tasks"].items()}
