"""Muon against torch.optim.Muon, per-head/per-expert units against separate parameters, and sharded across
1, 2 and 4 gloo ranks against one process — all bitwise."""

import tempfile
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks

from shipyard.train import muon as muon_module
from shipyard.train.muon import Muon, batched_newton_schulz, muon_param_groups, newton_schulz

LR, WD = 0.02, 0.1


def _grads(shapes, step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(*s, generator=g) for s in shapes]


def _init(shapes):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(*s, generator=g) for s in shapes]


def _run(opt_cls, params, shapes, steps=4, **kw):
    opt = opt_cls(params, lr=LR, weight_decay=WD, **kw)
    for step in range(steps):
        for p, g in zip(params, _grads(shapes, step), strict=True):
            p.grad = g
        opt.step()
    return params


def test_equals_torch_muon_on_plain_matrices():
    shapes = [(48, 16), (16, 48), (32, 32), (48, 16), (32, 32)]  # tall, wide, square; equal shapes batch together
    ours = _run(Muon, [torch.nn.Parameter(t) for t in _init(shapes)], shapes)
    ref = _run(torch.optim.Muon, [torch.nn.Parameter(t) for t in _init(shapes)], shapes,
               adjust_lr_fn="match_rms_adamw")
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


def test_newton_schulz_orthogonalizes():
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g).float())
    assert float(s.min()) > 0.6 and float(s.max()) < 1.25


def test_batched_newton_schulz_is_bitwise_the_per_unit_result(monkeypatch):
    g = torch.Generator().manual_seed(3)
    shapes = [(16, 40), (40, 16), (16, 40), (7, 9), (16, 40), (40, 16), (16, 40)]
    groups = [{"ns_steps": 5, "ns_coefficients": muon_module.NS_COEFFICIENTS, "eps": 1e-7}] * len(shapes)
    groups[3] = {**groups[3], "ns_steps": 3}
    units = [(torch.randn(*s, generator=g), grp) for s, grp in zip(shapes, groups, strict=True)]
    monkeypatch.setattr(muon_module, "NS_BATCH_ELEMENTS", 2 * 16 * 40)  # chunks of two units
    out = batched_newton_schulz(units)
    for (u, grp), o in zip(units, out, strict=True):
        assert torch.equal(o, newton_schulz(u, grp["ns_steps"], grp["ns_coefficients"], grp["eps"]))


def test_per_head_equals_heads_as_separate_parameters():
    heads, d, hidden = 4, 8, 24
    full = _init([(heads * d, hidden)])[0]
    grads = [_grads([(heads * d, hidden)], s)[0] for s in range(3)]
    q = torch.nn.Parameter(full.clone())
    opt = Muon([{"params": [q], "unit_rows": d}], lr=LR, weight_decay=WD)
    parts = [torch.nn.Parameter(full[h * d:(h + 1) * d].clone()) for h in range(heads)]
    ref = Muon(parts, lr=LR, weight_decay=WD)
    for g in grads:
        q.grad = g
        for h, p in enumerate(parts):
            p.grad = g[h * d:(h + 1) * d].clone()
        opt.step()
        ref.step()
    assert torch.equal(q.detach(), torch.cat([p.detach() for p in parts]))


def test_stacked_experts_equal_experts_as_separate_parameters():
    experts = _init([(3, 20, 12)])[0]
    w = torch.nn.Parameter(experts.clone())
    parts = [torch.nn.Parameter(experts[e].clone()) for e in range(3)]
    opt, ref = Muon([w], lr=LR, weight_decay=WD), Muon(parts, lr=LR, weight_decay=WD)
    for s in range(3):
        g = _grads([(3, 20, 12)], s)[0]
        w.grad = g
        for e, p in enumerate(parts):
            p.grad = g[e].clone()
        opt.step()
        ref.step()
    assert torch.equal(w.detach(), torch.stack([p.detach() for p in parts]))


def test_param_groups_cover_every_parameter_once():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config)
    muon, adamw = muon_param_groups(model)
    ids = [id(p) for g in muon + adamw for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    rows = {names[id(p)].split(".")[-2] if p.ndim == 2 else names[id(p)].split(".")[-1]: g["unit_rows"]
            for g in muon for p in g["params"]}
    assert rows["q_proj"] == 8 and rows["k_proj"] == 8 and rows["o_proj"] is None
    assert rows["gate_up_proj"] is None  # 3-D: one unit per expert by default
    adamw_names = {names[id(p)] for g in adamw for p in g["params"]}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adamw_names
    with pytest.raises(ValueError, match="every parameter matched"):
        muon_param_groups(model, adamw_patterns=(r".",), per_head=False)
    with pytest.raises(ValueError, match="q_proj.weight matches both"):
        muon_param_groups(model, adamw_patterns=(r"q_proj",))
    with pytest.raises(ValueError, match="1-D parameter"):
        Muon([torch.nn.Parameter(torch.zeros(4))])


# Sharded: rows split so that heads, experts and whole matrices straddle rank boundaries.
SHARDED = [((6 * 16, 40), 16), ((50, 30), None), ((3, 20, 12), None), ((5, 24), None)]


def _sharded_worker(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    shapes = [s for s, _ in SHARDED]
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in _init(shapes)]
    opt = Muon([{"params": [p], "unit_rows": rows} for p, (_, rows) in zip(params, SHARDED, strict=True)],
               lr=LR, weight_decay=WD)
    for step in range(3):
        for p, g in zip(params, _grads(shapes, step), strict=True):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
    full = [p.full_tensor() for p in params]
    if rank == 0:
        torch.save(full, out)


@pytest.fixture(scope="module")
def sharded_results():
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 4):
            out = Path(tmp) / f"w{world}.pt"
            run_ranks(_sharded_worker, world, str(out))
            results[world] = torch.load(out)
    return results


def test_sharded_across_2_and_4_ranks_is_bitwise_equal_to_one_process(sharded_results):
    shapes = [s for s, _ in SHARDED]
    params = [torch.nn.Parameter(t) for t in _init(shapes)]
    opt = Muon([{"params": [p], "unit_rows": rows} for p, (_, rows) in zip(params, SHARDED, strict=True)],
               lr=LR, weight_decay=WD)
    for step in range(3):
        for p, g in zip(params, _grads(shapes, step), strict=True):
            p.grad = g
        opt.step()
    for world, full in sharded_results.items():
        for a, b in zip(params, full, strict=True):
            assert torch.equal(a.detach(), b), f"world {world}, shape {tuple(a.shape)}"


def test_split_units_are_spread_over_ranks():
    from shipyard.train.muon import _Layout, plan_owners

    # Four whole 64 x 32 matrices, each split between 2 ranks: two owners each, not all on rank 0.
    lays = [_Layout(64, 32, 64, ((0, 32), (32, 64)), 0) for _ in range(4)]
    owners = plan_owners(lays, 2)
    assert sorted(owners.values()) == [0, 0, 1, 1]
    # Local work counts: rank 0 already has two whole units, rank 1 one, so the split unit goes to rank 1.
    lays = [_Layout(128, 32, 32, ((0, 80), (80, 128)), 0)]  # units 0, 1 on rank 0; 2 split; 3 on rank 1
    assert plan_owners(lays, 2) == {(0, 2): 1}
