"""A held-out split by project (`[run] held_out_projects`): every task of a held-out project is evaluated and none is
ever sampled for training; the split is recorded as task ids, and a resumed run keeps it. No model, no sandboxes."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
from tasksets import write_tasks, write_taskset

from shipyard.rl.build import held_out, split
from shipyard.rl.config import ConfigError, RLConfig, RunConfig, load_config
from shipyard.tasks.taskset import list_tasks


def config(tasks: Path, **run) -> RLConfig:
    return RLConfig(run=RunConfig(tasks=tasks, **run))


def test_every_task_of_a_held_out_project_is_evaluated_and_never_trained_on(tmp_path):
    ids = write_taskset(tmp_path, {"parse": 4, "cachetools": 3, "python-slugify": 2})
    curriculum, evals = split(config(tmp_path, held_out_projects=("cachetools", "Python_Slugify")), tmp_path)
    assert sorted(evals) == sorted(ids["cachetools"] + ids["python-slugify"])  # names compared in canonical form
    assert set(curriculum.tasks) == set(ids["parse"])
    assert set(curriculum.sample(500, random.Random(0))) <= set(ids["parse"])
    # With task ids too: the union. Recorded as ids in the run's config, a resumed run splits the same way.
    cfg = config(tmp_path, held_out=(ids["parse"][0],), held_out_projects=("cachetools",))
    _, evals = split(cfg, tmp_path)
    assert evals == [ids["parse"][0], *ids["cachetools"]]
    resumed = replace(cfg, run=replace(cfg.run, held_out=tuple(evals)))
    assert split(resumed, tmp_path)[1] == evals
    # Tasks of a held-out project added to the set later are held out too: the project decides, not a list of ids.
    more = write_taskset(tmp_path, {"cachetools-extra": 1})
    assert set(split(config(tmp_path, held_out_projects=("cachetools", "cachetools-extra")), tmp_path)[1]) == \
        set(ids["cachetools"] + more["cachetools-extra"])


def test_a_bad_split_by_project_is_a_config_error(tmp_path):
    write_taskset(tmp_path, {"parse": 2, "toolz": 1})
    with pytest.raises(ConfigError, match=r"no task of: \['attrs'\]; its projects: \['parse', 'toolz'\]"):
        split(config(tmp_path, held_out_projects=("attrs",)), tmp_path)
    with pytest.raises(ConfigError, match="leaves no task to train on"):
        split(config(tmp_path, held_out_projects=("parse", "toolz")), tmp_path)
    with pytest.raises(ValueError, match="held_out_projects .* or held_out_count"):
        RunConfig(held_out_projects=("parse",), held_out_count=1)
    # Without held_out_projects the projects are not even read: the old splits are unchanged.
    assert held_out(config(tmp_path, held_out_count=1), list_tasks(tmp_path)) in ([t] for t in list_tasks(tmp_path))


def test_a_task_that_deletes_code_of_a_held_out_task_is_held_out_too(tmp_path):
    # Tiers share symbols (synthesis keeps one task per symbol and tier): t1 empties f's body, t3 removes f whole.
    # Training on any task that deletes f — or on one that deletes another symbol of a task that does — teaches the
    # answer of the held-out task. The same function name in another project is other code.
    write_tasks(tmp_path, "p", {"t1-p.mod-f": (1, ["f"]), "t3-p.mod-f": (3, ["f"]), "t2-p.mod-f-g": (2, ["f", "g"]),
                                "t1-p.mod-g": (1, ["g"]), "t1-p.mod-h": (1, ["h"])})
    write_tasks(tmp_path, "q", {"t1-q.mod-f": (1, ["f"])})
    curriculum, evals = split(config(tmp_path, held_out=("t1-p.mod-f",)), tmp_path)
    assert evals == ["t1-p.mod-f", "t3-p.mod-f", "t2-p.mod-f-g", "t1-p.mod-g"]
    assert set(curriculum.tasks) == {"t1-p.mod-h", "t1-q.mod-f"}
    resumed = config(tmp_path, held_out=tuple(evals))  # as recorded in the run's config: the same split
    assert split(resumed, tmp_path)[1] == evals
    assert split(config(tmp_path, held_out=("t1-p.mod-h",)), tmp_path)[1] == ["t1-p.mod-h"]
    with pytest.raises(ConfigError, match="leaves no task to train on"):
        split(config(tmp_path, held_out=("t1-p.mod-g", "t1-q.mod-f", "t1-p.mod-h")), tmp_path)


def test_held_out_projects_is_a_config_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[run]\nheld_out_projects = ["parse", "toolz"]\n')
    assert load_config(path).run.held_out_projects == ("parse", "toolz")
    assert load_config(path, ["--run.held-out-projects", "attrs"]).run.held_out_projects == ("attrs",)
