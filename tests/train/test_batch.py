"""`Batch` from trajectories: padding, masks, versions, failed samples, and hint placement for distillation."""

import pytest
import torch

from shipyard.harness.tools import default_tools
from shipyard.harness.trajectory import Trajectory, Turn
from shipyard.harness.wire import ChatFormat
from shipyard.models.tokenizer import byte_tokenizer
from shipyard.rollout.record import Hint
from shipyard.train.batch import Batch, place_hint, turn_span
from shipyard.train.distill import teacher_row

TOK = byte_tokenizer()
FMT = ChatFormat(TOK, default_tools())


def _trajectory(replies: list[str], version0: int = 3) -> Trajectory:
    traj = Trajectory("task", "tiny", FMT.prompt_ids("fix the bug"))
    for i, reply in enumerate(replies):
        ids = FMT.encode(reply) + [TOK.convert_tokens_to_ids("<|im_end|>")]
        obs = FMT.continuation_ids(ids, [f"result {i}"]) if i < len(replies) - 1 else []
        traj.turns.append(Turn(i, reply, ids, [-0.5] * len(ids), "stop", obs, [], 0, 0.0, 0.0,
                               policy_version=version0 + i))
    return traj


def test_padding_masks_and_versions():
    a, b = _trajectory(["look", "edit it"]), _trajectory(["done"])
    batch = Batch.from_trajectories([a, b], [1.0, -0.5], pad_id=TOK.pad_token_id, failed=[False, True])
    assert batch.input_ids.shape == (2, len(a.token_ids()))
    assert batch.input_ids[1, len(b.token_ids()):].eq(TOK.pad_token_id).all()
    assert batch.attention_mask[1].sum() == len(b.token_ids())
    for row, traj in enumerate((a, b)):
        sampled = {p for k in range(len(traj.turns)) for p in range(*turn_span(traj, k))}
        assert {int(p) for p in batch.loss_mask[row].nonzero()} == sampled
        assert batch.sampler_logprobs[row][batch.loss_mask[row] == 1].eq(-0.5).all()
    start, end = turn_span(a, 1)
    assert batch.versions[0, start:end].eq(4).all() and batch.versions[0, :len(a.prompt_ids)].eq(0).all()
    assert batch.advantages[0, 0] == 1.0 and batch.advantages[1, 3] == -0.5
    assert batch.sample_mask.tolist() == [1.0, 0.0]
    assert batch.tokens == int(batch.loss_mask[0].sum())  # the failed sample counts for nothing


def test_hint_goes_before_the_target_turns_header_and_leaves_the_student_untouched():
    traj = _trajectory(["cat README", "sed -i wrongly", "done"])
    header = FMT.assistant_header_ids()
    hint = Hint(0, 1, FMT.hint_ids("Hint: read the failing test before editing."))
    batch = Batch.from_trajectories([traj], [0.0], pad_id=TOK.pad_token_id, hints=[hint], header_ids=header)
    (target,) = batch.hints
    start, end = turn_span(traj, 1)
    assert (target.start, target.end) == (start, end)
    student = batch.input_ids[0].clone()
    teacher, shift = teacher_row(batch.input_ids[0], target)
    assert torch.equal(batch.input_ids[0], student)  # nothing written into the student's row
    assert torch.equal(teacher[:target.insert_at], student[:target.insert_at])
    assert torch.equal(teacher[target.insert_at + shift:], student[target.insert_at:])
    text = TOK.decode(teacher[:end + shift])
    assert text.endswith("<|im_start|>user\nHint: read the failing test before editing.<|im_end|>\n"
                         "<|im_start|>assistant\nsed -i wrongly<|im_end|>")
    # The loss covers exactly the target turn: student positions [start, end) ↔ teacher [start+shift, end+shift).
    assert torch.equal(teacher[start + shift:end + shift], student[start:end])


def test_bad_hints_are_refused():
    traj = _trajectory(["a", "b"])
    with pytest.raises(ValueError, match="turn 5 does not exist"):
        place_hint(traj, Hint(0, 5, (1,)), FMT.assistant_header_ids())
    with pytest.raises(ValueError, match="assistant header"):
        place_hint(traj, Hint(0, 1, (1,)), (7, 7, 7))
    with pytest.raises(ValueError, match="advantages"):
        Batch.from_trajectories([traj], [], pad_id=0)


def test_rows_renumbers_hints():
    trajs = [_trajectory(["a", "b"]), _trajectory(["c", "d"])]
    batch = Batch.from_trajectories(trajs, [1.0, 2.0], pad_id=0, hints=[Hint(1, 1, (5, 6))],
                                    header_ids=FMT.assistant_header_ids())
    sub = batch.rows([1])
    assert sub.size == 1 and sub.advantages[0, 0] == 2.0
    assert [h.sample for h in sub.hints] == [0]
    assert batch.rows([0]).hints == []


def test_trimmed_cuts_each_row_after_its_last_trained_token():
    trajs = [_trajectory(["a", "b"]), _trajectory(["c"])]
    trajs[0].turns[-1].observation_ids = [7] * 50  # a final tool output: never trained on
    batch = Batch.from_trajectories(trajs, [1.0, 2.0], pad_id=0, failed=[False, False])
    batch.loss_mask[1] = 0  # nothing trained in row 1: two tokens left
    cut = batch.trimmed()
    end = turn_span(trajs[0], 1)[1]
    assert cut.attention_mask.sum(-1).tolist() == [end, 2] and cut.trained().any(-1).tolist() == [True, False]
    assert cut.input_ids.shape[1] == end and torch.equal(cut.input_ids[0], batch.input_ids[0, :end])
    assert cut.tokens == batch.tokens
    assert cut.sampler_logprobs[0, end:].eq(0).all() and cut.input_ids[1, 2:].eq(0).all()
    # a hint's target keeps its span even where the loss mask was cut (stale tokens)
    hinted = Batch.from_trajectories([trajs[0]], [1.0], pad_id=0, hints=[Hint(0, 1, (5, 6))],
                                     header_ids=FMT.assistant_header_ids())
    hinted.loss_mask[0, turn_span(trajs[0], 1)[0]:] = 0
    assert hinted.trimmed().attention_mask.sum() == end
