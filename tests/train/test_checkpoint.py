"""Checkpoints: resuming continues bit-identically (weights, EMA teacher, Muon and AdamW state, schedule) on the same
number of ranks, and like the uninterrupted run on another number (torch.distributed.checkpoint resharding)."""

import tempfile
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks
from safetensors.torch import load_file

from shipyard.harness.tools import default_tools
from shipyard.harness.wire import ChatFormat
from shipyard.models.resolve import tiny_model
from shipyard.rollout.record import Hint
from shipyard.train.batch import Batch
from shipyard.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from shipyard.train.distill import DistillConfig
from shipyard.train.trainer import OptimConfig, TrainConfig, Trainer

ADV = [[1.0, -1.0], [0.5, -0.5], [-0.25, 0.75], [0.3, -0.3]]


def _trainer() -> Trainer:
    model, tok = tiny_model(seed=4)
    config = TrainConfig(optim=OptimConfig(name="muon", lr=1e-3, warmup_steps=3), micro_batch=1,
                         distill=DistillConfig(enabled=True, weight=0.3, teacher="ema", ema_decay=0.9))
    return Trainer(model.float(), config, pad_id=tok.pad_token_id,
                   header_ids=ChatFormat(tok, default_tools()).assistant_header_ids())


def _batches(episodes, trainer):
    fmt = ChatFormat(tiny_model()[1], default_tools())
    multi = [t for t in episodes if len(t.turns) >= 2][:2]
    return [Batch.from_trajectories(multi, adv, pad_id=trainer.pad_id, header_ids=trainer.header_ids,
                                    hints=[Hint(0, 1, fmt.hint_ids(f"hint {i}"))]) for i, adv in enumerate(ADV)]


def test_resume_continues_bit_identically(episodes, tmp_path):
    straight = _trainer()
    batches = _batches(episodes, straight)
    want = [straight.step(b) for b in batches]

    first = _trainer()
    for b in batches[:2]:
        first.step(b)
    path = save_checkpoint(first, tmp_path / "ckpt")
    assert path.name == "step-00000002" and latest_checkpoint(tmp_path / "ckpt") == path
    weights = load_file(path / "model.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in first.full_state_dict().items() if k in weights)
    assert "lm_head.weight" not in weights  # tied to the embedding: stored once

    resumed = _trainer()
    load_checkpoint(resumed, path)
    assert resumed.version == 2 and resumed.schedulers[0].get_last_lr() == first.schedulers[0].get_last_lr()
    got = [resumed.step(b) for b in batches[2:]]
    for k, v in straight.full_state_dict().items():
        assert torch.equal(v, resumed.full_state_dict()[k]), k
    for k, v in straight.ema.state_dict().items():
        assert torch.equal(v, resumed.ema.state_dict()[k]), k
    for a, b in zip(want[2:], got, strict=True):
        assert a["policy_loss"] == b["policy_loss"] and a["distill_loss"] == b["distill_loss"]


def test_bad_checkpoints_are_refused(episodes, tmp_path):
    trainer = _trainer()
    with pytest.raises(FileNotFoundError, match="not a shipyard checkpoint"):
        load_checkpoint(trainer, tmp_path)
    path = save_checkpoint(trainer, tmp_path)
    (path / "trainer.json").write_text((path / "trainer.json").read_text().replace('"ema"', '"teacher"'))
    with pytest.raises(ValueError, match="distillation teacher or KL reference"):
        load_checkpoint(trainer, path)
    (path / "dcp" / ".metadata").unlink()
    with pytest.raises(FileNotFoundError, match="no dcp/ shards"):
        load_checkpoint(trainer, path)


def _reshard_worker(rank, world, episodes, ckpt, mode, out):
    """mode "save": two steps, checkpoint, two more steps (the uninterrupted run); "load": resume, two steps."""
    trainer = _trainer()
    batches = _batches(episodes, trainer)
    if mode == "save":
        for b in batches[:2]:
            trainer.step(b)
        save_checkpoint(trainer, ckpt)
    else:
        load_checkpoint(trainer, latest_checkpoint(ckpt))
        assert trainer.version == 2
    for b in batches[2:]:
        trainer.step(b)
    full = trainer.full_state_dict()  # gathered to rank 0 alone, on its CPU
    if rank == 0:
        assert full["lm_head.weight"] is full["model.embed_tokens.weight"]  # tied, on any number of ranks: stored once
        assert all(v.device.type == "cpu" for v in full.values())
        torch.save({k: v.clone() for k, v in full.items()}, out)
    else:
        assert full == {}  # no other rank holds the whole model


def _run(world, episodes, ckpt, mode, out):
    if world == 1:
        _reshard_worker(0, 1, episodes, ckpt, mode, out)
    else:
        run_ranks(_reshard_worker, world, episodes, str(ckpt), mode, str(out))
    return torch.load(out)


@pytest.mark.parametrize("saved, loaded", [(2, 1), (1, 2), (2, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(episodes, saved, loaded):
    """The resumed run matches the uninterrupted one: bitwise on the same number of ranks, to float-summation
    accuracy on another (N ranks train like 1: tests/train/test_trainer.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        straight = _run(saved, episodes, tmp / "ckpt", "save", tmp / "straight.pt")
        resumed = _run(loaded, episodes, tmp / "ckpt", "load", tmp / "resumed.pt")
    for k, v in straight.items():
        if saved == loaded:
            assert torch.equal(v, resumed[k]), k
        else:
            torch.testing.assert_close(resumed[k], v, rtol=1e-4, atol=1e-6, msg=k)


def test_only_the_newest_checkpoints_are_kept_and_nothing_else_is_touched(episodes, tmp_path):
    from shipyard.train.checkpoint import prune

    trainer = _trainer()
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-00000000.partial").mkdir(parents=True)  # a save that crashed before any finished
    (ckpt / "step-notes").mkdir()  # not a checkpoint: the user's
    saved = []
    for batch in _batches(episodes, trainer)[:3]:
        trainer.step(batch)
        saved.append(save_checkpoint(trainer, ckpt, keep=2))
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002", "step-00000003", "step-notes"]
    assert latest_checkpoint(ckpt) == saved[-1]
    (ckpt / "step-00000009.partial").mkdir()  # a save under way (or crashed) after the newest complete one: kept
    assert [p.name for p in prune(ckpt, 1)] == ["step-00000002"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000003", "step-00000009.partial", "step-notes"]


def test_a_checkpoint_that_would_not_fit_is_refused_before_anything_is_written(episodes, tmp_path, monkeypatch):
    """A full disk failed a 5-hour SFT stage deep inside torch.save ("unexpected pos 704 vs 598"): the space the
    checkpoint's tensors need is checked first, and the message says what to change. The free space is the one
    thing faked: how much a disk holds is the machine's, not the code's."""
    from shipyard.train import checkpoint

    trainer = _trainer()
    trainer.step(_batches(episodes, trainer)[0])
    ckpt = tmp_path / "ckpt"
    fits = save_checkpoint(trainer, ckpt)  # the real disk has room
    need = sum(f.stat().st_size for f in fits.rglob("*") if f.is_file())
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: need // 4)
    trainer.step(_batches(episodes, trainer)[1])
    (ckpt / "step-00000002.partial").mkdir()  # what the save that filled the disk left: not counted, removed
    (ckpt / "step-00000002.partial" / "dcp").write_bytes(b"\0" * need)
    with pytest.raises(checkpoint.CheckpointSpaceError, match=r"step 2 needs ~.* MiB free .*keep_checkpoints = 1"):
        save_checkpoint(trainer, ckpt, keep=2)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000001"]  # nothing written, nothing else pruned
