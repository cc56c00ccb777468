"""train-embedder: pairs from rewarded sessions (what was used after each query), batches, training, evaluation."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from shipyard.harness.trajectory import CallRecord, Trajectory, Turn
from shipyard.search.finetune import Pair, batches, pairs_from_rollouts, recall_at, session_pairs, split_by_task, train
from shipyard.search.index import embedding_text


def turn(index, *calls):
    return Turn(index, "", [], [], "stop", [], [CallRecord(i, name, args, "ok", error, 0.0)
                                                 for i, (name, args, error) in enumerate(calls)], len(calls), 0.0, 0.0)


def session():
    return Trajectory("Implement `median` in pocketlib/stats.py.", "m", [], turns=[
        turn(0, ("read_file", {"path": "pocketlib/roman.py", "offset": 10, "limit": 5}, None)),
        turn(1, ("codebase_search", {"query": "middle value of a sorted list"}, None)),
        turn(2, ("read_file", {"path": "pocketlib/stats.py", "offset": 20, "limit": 3}, None),
             ("read_file", {"path": "pocketlib/intervals.py", "offset": 1, "limit": 5}, "error: boom")),
        turn(3, ("search_replace", {"path": "pocketlib/stats.py", "old_string": "def mode(", "new_string": "x"},
                 None),
             ("write_file", {"path": "README.md", "content": "x"}, None),
             ("read_file", {"path": "../../etc/passwd"}, None)),
    ])


@pytest.fixture
def task_set(tmp_path, repo):
    for task in ("t-a", "t-b", "t-c"):
        shutil.copytree(repo, tmp_path / "tasks" / task / "snapshot")
    return tmp_path / "tasks"


def test_positives_are_what_the_session_used_after_each_query(task_set, tiny_embedder):
    pairs = session_pairs(session(), "t-a", task_set / "t-a" / "snapshot", tiny_embedder)
    by_query = {}
    for p in pairs:
        by_query.setdefault(p.query, set()).add((p.positive.path, p.positive.symbol))
    statement = by_query["Implement `median` in pocketlib/stats.py."]
    searched = by_query["middle value of a sorted list"]
    assert ("pocketlib/roman.py", "to_roman") in statement  # read before the search: the statement's only
    assert ("pocketlib/roman.py", "to_roman") not in searched
    assert {("pocketlib/stats.py", "median"), ("pocketlib/stats.py", "mode")} <= searched  # read, then edited
    assert any(path == "README.md" for path, _ in searched)  # written whole
    assert not any(path.startswith("pocketlib/intervals") for path, _ in statement | searched)  # a failed call
    assert all(p.positive.text for p in pairs)


def test_only_rewarded_sessions_of_known_tasks_count_and_bad_files_are_named(task_set, tmp_path, tiny_embedder):
    lines = [{"task_id": "t-a", "reward": 1.0, "trajectory": asdict(session())},
             {"task_id": "t-b", "reward": 0.0, "trajectory": asdict(session())},
             {"task_id": "t-c", "reward": None, "trajectory": asdict(session())},
             {"task_id": "gone", "reward": 1.0, "trajectory": asdict(session())}]
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n")
    pairs = pairs_from_rollouts([rollouts], task_set, tiny_embedder)
    assert pairs and {p.task_id for p in pairs} == {"t-a"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"no": "task"}\n')
    with pytest.raises(ValueError, match="line 1 is not a saved rollout"):
        pairs_from_rollouts([bad], task_set, tiny_embedder)


def test_batches_never_hold_a_query_or_a_positive_twice(task_set, tiny_embedder):
    pairs = session_pairs(session(), "t-a", task_set / "t-a" / "snapshot", tiny_embedder)
    for batch in batches(pairs * 2, 4, random.Random(0)):
        assert len({p.query for p in batch}) == len(batch) == len({p.positive for p in batch})
    assert sum(len(b) for b in batches(pairs, 4, random.Random(0))) == len(pairs)
    train_pairs, test_pairs = split_by_task([Pair(t, "q", p.positive) for t in "abcd" for p in pairs[:1]], 0.25, 0)
    assert len({p.task_id for p in test_pairs}) == 1 and not {p.task_id for p in test_pairs} & {
        p.task_id for p in train_pairs}


def test_training_pulls_the_pairs_together_and_leaves_the_base_alone(task_set, tmp_path, tiny_embedder):
    pairs = session_pairs(session(), "t-a", task_set / "t-a" / "snapshot", tiny_embedder)
    base_dir = Path(tiny_embedder.name)
    base_weights = {p.name: p.read_bytes() for p in base_dir.iterdir() if p.is_file()}

    chunks = sorted({p.positive for p in pairs}, key=lambda c: (c.path, c.start))
    positives = {(p.query, p.positive) for p in pairs}

    def margin(embedder):
        """Mean over pairs of: the query's similarity to its positive minus its mean similarity to the other chunks."""
        queries = sorted({p.query for p in pairs})
        sims = embedder.embed(queries) @ embedder.embed([embedding_text(c) for c in chunks]).T
        out = []
        for i, q in enumerate(queries):
            own = [sims[i, j] for j, c in enumerate(chunks) if (q, c) in positives]
            other = [sims[i, j] for j, c in enumerate(chunks) if (q, c) not in positives]
            if other:  # the statement's positives are every chunk used: no margin to measure
                out.append(np.mean(own) - np.mean(other))
        return float(np.mean(out))

    before = margin(tiny_embedder)
    tuned = train(tiny_embedder.name, pairs, tmp_path / "tuned", epochs=10, batch_size=4, lr=1e-3)
    assert margin(tuned) > before + 0.02 and margin(tuned) > 0
    assert margin(tiny_embedder) == pytest.approx(before)  # the caller's embedder was not trained
    assert base_weights == {p.name: p.read_bytes() for p in base_dir.iterdir() if p.is_file()}
    assert (tmp_path / "tuned" / "modules.json").exists()
    recall = recall_at(tuned, pairs, task_set)
    queries = len({(p.task_id, p.query) for p in pairs})
    # trained on these pairs, both queries find a positive among their 10 best hits (the untrained embedder: one)
    assert (queries, recall) == (2, 1.0) and recall_at(tiny_embedder, pairs, task_set) < recall
