"""What the trainer does to the model it is given and what it builds beside it: the caller's module is never
converted behind its back, the EMA teacher (a whole copy of the model) exists only when hints can arrive, and the
CPU defaults are the fast choices."""

import pytest
import torch

from shipyard.models.resolve import tiny_model
from shipyard.train.batch import Batch, HintTarget
from shipyard.train.distill import DistillConfig
from shipyard.train.muon import Muon
from shipyard.train.trainer import OptimConfig, TrainConfig, Trainer, default_optimizer


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 200, (2, 24), generator=g)
    ids[1, :16] = ids[0, :16]
    shape = ids.shape
    loss = torch.zeros(shape)
    loss[:, 12:] = 1.0
    adv = torch.tensor([[1.0], [-1.0]]).expand(shape).clone()
    return Batch(ids, torch.ones_like(ids), loss, torch.full(shape, -2.0), adv, torch.zeros_like(ids),
                 torch.ones(2), pad_id=0)


def test_a_bfloat16_model_is_refused_not_converted():
    model = tiny_model(seed=1)[0].to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="in_place = false"):
        Trainer(model, TrainConfig(), pad_id=0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_in_place_false_trains_a_copy_and_leaves_the_callers_module_alone():
    model = tiny_model(seed=1)[0].to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, TrainConfig(optim=OptimConfig(lr=1e-2), in_place=False), pad_id=0)
    trainer.step(_batch())
    assert trainer.model is not model and all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not torch.equal(trainer.full_state_dict()["model.layers.0.mlp.up_proj.weight"].bfloat16(),
                           before["model.layers.0.mlp.up_proj.weight"])


def test_in_place_trains_the_given_float32_module_and_nothing_else_about_it():
    model = tiny_model(seed=1)[0]
    weight = model.model.layers[0].mlp.up_proj.weight
    before = weight.detach().clone()
    trainer = Trainer(model, TrainConfig(optim=OptimConfig(lr=1e-2)), pad_id=0)
    trainer.step(_batch())
    assert trainer.model is model and model.model.layers[0].mlp.up_proj.weight is weight
    assert weight.dtype == torch.float32 and not torch.equal(weight.detach(), before)


def test_no_teacher_copy_unless_hints_can_arrive():
    model = tiny_model(seed=1)[0]
    plain = Trainer(model, TrainConfig(), pad_id=0)  # the default distillation weight is 1, but hints are off
    assert plain.ema is None and plain.reference is None and not plain.distilling
    hinted = _batch()
    hinted.hints = [HintTarget(0, 10, (5, 6), 12, 16)]
    with pytest.raises(ValueError, match="distill.enabled = true"):
        plain.step(hinted)
    off = Trainer(tiny_model(seed=1)[0], TrainConfig(distill=DistillConfig(enabled=True, weight=0.0)), pad_id=0)
    assert off.ema is None
    # every hint kept, whatever its lift (the random model's has either sign)
    on = Trainer(tiny_model(seed=1)[0], TrainConfig(distill=DistillConfig(enabled=True, min_lift=-1e9)), pad_id=0)
    assert type(on.ema) is type(on.model) and on.ema is not on.model  # the teacher: its own copy, equal at the start
    student, teacher = on.model.state_dict(), on.ema.state_dict()
    assert student.keys() == teacher.keys() and all(torch.equal(v, teacher[k]) for k, v in student.items())
    metrics = on.step(hinted)
    assert metrics["distill_tokens"] == 4.0 and metrics["hints"] == metrics["hints_kept"] == 1


def test_cpu_defaults_are_adamw_and_gpu_configs_choose_muon():
    assert OptimConfig().name == "adamw" == default_optimizer("cpu")
    assert default_optimizer("cuda") == "muon" == default_optimizer("cuda:1")
    trainer = Trainer(tiny_model(seed=1)[0], TrainConfig(), pad_id=0)
    assert [type(o) for o in trainer.optimizers] == [torch.optim.AdamW]
    muon = Trainer(tiny_model(seed=1)[0], TrainConfig(optim=OptimConfig(name="muon")), pad_id=0)
    assert [type(o) for o in muon.optimizers] == [Muon, torch.optim.AdamW]  # AdamW: embeddings, head, norms, …
