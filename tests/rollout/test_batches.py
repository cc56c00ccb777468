"""RolloutBatch → metrics JSON lines and `Batch.from_rollouts` tensors (versions, masks, advantages, hints)."""

from __future__ import annotations

import json

import pytest
import torch
from schedfakes import turn

from shipyard.harness.trajectory import Trajectory
from shipyard.rollout.batches import RolloutBatch, RolloutGroup
from shipyard.rollout.record import Hint, Rollout
from shipyard.train.batch import Batch

HEADER = (50, 51)


def traj(turns: list[tuple[int, int]], token_versions=None) -> Trajectory:
    """Prompt [1, 2, 50, 51]; each turn (tokens, version) samples `tokens` 7s then observes [9, 9, 50, 51]."""
    t = Trajectory(task="t", model="m", prompt_ids=[1, 2, *HEADER])
    for i, (n, v) in enumerate(turns):
        tr = turn(i, v, n)
        tr.observation_ids = [9, 9, *HEADER]
        tr.logprobs = [-0.1 * (i + 1)] * n
        t.turns.append(tr)
    if token_versions is not None:
        t.turns[-1].token_versions = token_versions
    return t


def rollout(index, reward, trajectory, advantage):
    return Rollout("t", "t@0", index, 100 + index, "graded" if reward is not None else "infra_error", reward,
                   trajectory=trajectory, advantage=advantage)


@pytest.fixture
def batch() -> RolloutBatch:
    group = RolloutGroup("t", "t@0", [
        rollout(0, 1.0, traj([(2, 3), (3, 4)], token_versions=[4, 4, 5]), 0.5),  # last turn spans an update
        rollout(1, 0.0, traj([(1, 4)]), -0.5),
        rollout(2, None, None, 0.0),  # an infra failure with nothing to keep
        rollout(3, None, traj([(2, 4)]), 0.0),  # an infra failure mid-episode
    ], started_version=3)
    return RolloutBatch([group], step=2, trainer_version=5)


def test_rollout_batch_views(batch):
    assert batch.masks == [1, 1, 0, 0]
    assert batch.advantages == [0.5, -0.5, 0.0, 0.0]
    assert batch.versions == [[3, 4], [4], [], [4]]
    assert batch.staleness() == [2, 1, 0, 1]
    assert batch.groups[0].oldest_version == 3
    assert batch.summary()["masked"] == 2 and batch.summary()["mean_reward"] == 0.5


def test_metrics_are_json_lines(batch, tmp_path):
    path = tmp_path / "m" / "rollouts.jsonl"
    batch.write_metrics(path)
    batch.write_metrics(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 8
    assert lines[0]["rollout"] == "t@0/0" and lines[0]["staleness"] == 2 and lines[0]["step"] == 2
    assert lines[0]["advantage"] == 0.5 and lines[0]["versions"] == [3, 4]
    assert lines[2]["reward"] is None and lines[2]["status"] == "infra_error"


def test_from_rollouts_tensors(batch):
    b = Batch.from_rollouts(batch, pad_id=0, header_ids=HEADER)
    assert b.size == 4
    # row 0: prompt 4, turn0 2 sampled + 4 obs, turn1 3 sampled + 4 obs = 17 tokens
    assert b.input_ids.shape == (4, 17)
    assert b.input_ids[0].tolist() == [1, 2, 50, 51, 7, 7, 9, 9, 50, 51, 7, 7, 7, 9, 9, 50, 51]
    assert b.loss_mask[0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    assert b.versions[0].tolist() == [0, 0, 0, 0, 3, 3, 0, 0, 0, 0, 4, 4, 5, 0, 0, 0, 0]  # token_versions honoured
    assert b.sampler_logprobs[0, 4].item() == pytest.approx(-0.1) and b.sampler_logprobs[0, 10].item() == \
        pytest.approx(-0.2)
    assert torch.all(b.advantages[0, :17] == 0.5) and torch.all(b.advantages[1, :9] == -0.5)
    assert b.sample_mask.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert b.attention_mask[2].sum().item() == 0  # no trajectory: an empty, masked row
    assert b.tokens == 5 + 1  # masked rows contribute nothing


def test_from_rollouts_places_hints(batch):
    batch.hints.append(Hint(sample=0, turn=1, hint_ids=(60, 61)))
    b = Batch.from_rollouts(batch, pad_id=0, header_ids=HEADER)
    [h] = b.hints
    assert (h.sample, h.insert_at, h.start, h.end) == (0, 8, 10, 13)


def test_from_rollouts_refuses_mismatched_token_versions(batch):
    batch.groups[0].rollouts[0].trajectory.turns[1].token_versions = [4, 5]
    with pytest.raises(ValueError, match="2 token versions for 3 tokens"):
        Batch.from_rollouts(batch, pad_id=0)


def test_tokens_older_than_min_version_are_context_not_trained(batch):
    """A straggler's stale tokens stay in the row (the model still sees them) but get loss mask 0 — per token, also
    inside a completion that spanned an update."""
    batch.min_version = 4  # trainer version 5, η = 1
    b = Batch.from_rollouts(batch, pad_id=0, header_ids=HEADER)
    assert b.input_ids[0].tolist()[4:6] == [7, 7]  # turn 0 (version 3) is still there …
    assert b.loss_mask[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]  # … but not trained on
    batch.min_version = 5
    b = Batch.from_rollouts(batch, pad_id=0, header_ids=HEADER)
    assert b.loss_mask[0, 10:13].tolist() == [0, 0, 1]  # token versions 4, 4, 5
    assert b.loss_mask[1].sum().item() == 0  # version 4: its whole completion is context now
    assert b.tokens == 1
    assert torch.all(b.versions[b.loss_mask > 0] >= 5)


def test_hints_distil_only_into_fresh_tokens(batch):
    """Review: a hint on a stale turn was still distilled (and, on a row with nothing trainable, crashed the
    trainer). Its target is cut to the turn's fresh tokens, or dropped when none is fresh."""
    batch.hints += [Hint(sample=0, turn=0, hint_ids=(60,)), Hint(sample=0, turn=1, hint_ids=(61,))]
    batch.min_version = 5  # turn 0 (version 3) stale; turn 1: token versions 4, 4, 5
    b = Batch.from_rollouts(batch, pad_id=0, header_ids=HEADER)
    [h] = b.hints
    assert (h.sample, h.hint_ids, h.start, h.end) == (0, (61,), 12, 13)  # only the version-5 token
    assert b.loss_mask[0, h.start:h.end].tolist() == [1.0]
