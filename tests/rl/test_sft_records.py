"""Rollout records that SFT reads from files anyone can write (`shipyard eval --rollouts`, a run's trajectories/):
a record whose token views cannot be trained on is one line naming the file and the line, before any replay or
training starts — never a traceback mid-run, and never ids the embedding would index out of range or truncate."""

from __future__ import annotations

import json

import pytest

from shipyard.errors import FileFormatError
from shipyard.harness.trajectory import Trajectory, Turn
from shipyard.rl.sft import read_rollouts
from shipyard.rollout.record import Rollout


def _record() -> dict:
    traj = Trajectory(task="t", model="m", prompt_ids=[1, 2],
                      turns=[Turn(index=0, text="x", completion_ids=[3, 4], logprobs=[0.0, -0.5], finish_reason="stop",
                                  observation_ids=[5], calls=[], parallel_width=0, generate_seconds=0.0,
                                  tools_seconds=0.0)])
    return Rollout(task_id="a", group_id="a@eval", index=0, seed=0, status="passed", reward=1.0,
                   trajectory=traj).to_json()


def _turn(record: dict) -> dict:
    return record["trajectory"]["turns"][0]


@pytest.mark.parametrize("spoil, why", [
    (lambda r: _turn(r).update(completion_ids=[-5, 4]), "completion_ids"),  # an embedding index out of range
    (lambda r: _turn(r).update(completion_ids=[3.7, 4]), "completion_ids"),  # a float, truncated to 3 by torch
    (lambda r: _turn(r).update(completion_ids=[True, 4]), "completion_ids"),
    (lambda r: _turn(r).update(completion_ids="ab"), "completion_ids"),  # was a TypeError in training
    (lambda r: r["trajectory"].update(prompt_ids=[1, None]), "prompt_ids"),
    (lambda r: _turn(r).update(observation_ids=[{}]), "observation_ids"),
    (lambda r: _turn(r).update(logprobs=[0.0]), "logprobs"),  # was a RuntimeError building the batch
    (lambda r: _turn(r).update(logprobs=["x", 0.0]), "logprobs"),
    (lambda r: _turn(r).update(token_versions=[1]), "token_versions"),
])
def test_a_record_whose_tokens_cannot_be_trained_on_is_a_one_line_error(tmp_path, spoil, why):
    good, bad = _record(), _record()
    spoil(bad)
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(FileFormatError, match=rf"rollouts.jsonl:2: not a rollout record .*{why}"):
        read_rollouts(path)


def test_a_line_nested_too_deeply_to_parse_is_a_one_line_error(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(_record()) + "\n" + '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(FileFormatError, match=r"deep.jsonl:2: not a rollout record"):
        read_rollouts(path)


def test_a_well_formed_record_still_reads():
    record = _record()
    assert Rollout.from_json(record).to_json() == record
