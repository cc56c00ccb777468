"""Shared prefixes computed once: logits, loss and every gradient equal the per-row computation (oracle: each row
forwarded on its own, unpacked); micro-batches count unique tokens; a step's forward cost follows them."""

import gc
from pathlib import Path

import pytest
import torch
from own_memory import in_child

from shipyard.models.resolve import tiny_model
from shipyard.train.batch import Batch, HintTarget
from shipyard.train.distill import DistillConfig
from shipyard.train.packing import pack
from shipyard.train.prefix import cascade, forward_cascade, groups, micro_batches, supports_cascade
from shipyard.train.trainer import OptimConfig, TrainConfig, Trainer

PAD = 0


def _rows(seed: int = 0, prompt: int = 40) -> list[torch.Tensor]:
    """A group of 4 (suffixes of different lengths, one row that is only part of the prompt), a row of another
    prompt, and a second group of 2 that agrees on its first sampled tokens too."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(1, 200, (prompt,), generator=g)
    q = torch.randint(1, 200, (prompt // 2,), generator=g)
    common = torch.randint(1, 200, (6,), generator=g)
    return ([torch.cat([p, torch.randint(1, 200, (n,), generator=g)]) for n in (5, 9, 1)] + [p[:35].clone()]
            + [torch.randint(1, 200, (30,), generator=g)]
            + [torch.cat([q, common, torch.randint(1, 200, (n,), generator=g)]) for n in (3, 11)])


def _padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows) + 3  # trailing padding on every row
    ids, att = torch.full((len(rows), width), PAD), torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], att[i, :len(r)] = r, 1
    return ids, att


def _grads(model) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float) -> None:
    for k in a:
        assert float((a[k] - b[k]).abs().max()) <= rel * float(b[k].abs().max()) + 1e-12, k


def test_groups_come_from_the_ids_whatever_the_order():
    ids, att = _padded(_rows())
    lengths = att.sum(-1).tolist()
    assert [(g.rows, g.prefix) for g in groups(ids, lengths, 16)] == [((0, 1, 2, 3), 35), ((4,), 0), ((5, 6), 26)]
    perm = [6, 4, 0, 5, 3, 1, 2]
    found = groups(ids[perm], [lengths[i] for i in perm], 16)
    assert sorted((tuple(sorted(perm[r] for r in g.rows)), g.prefix) for g in found) == [
        ((0, 1, 2, 3), 35), ((4,), 0), ((5, 6), 26)]
    assert [g.rows for g in groups(ids, lengths, 0)] == [(i,) for i in range(len(lengths))]  # 0: no sharing


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_forward_equals_each_row_alone(attention):
    """float64 model: logits to float64 precision; gradients to ~1e-7 relative, because transformers computes the
    attention softmax in float32 and the shared prefix's gradient is summed before that rounding, not after."""
    model = tiny_model(seed=1)[0].double()
    model.config._attn_implementation = attention
    rows = _rows()
    ids, att = _padded(rows)
    g = torch.Generator().manual_seed(1)
    keep = att.bool() & (torch.rand(att.shape, generator=g) > 0.3)
    layout = cascade(ids, att, PAD, 16)
    # The group of 4 shares 34 tokens (one short of its shortest row, which keeps one token of its own), the lone
    # row computes its first token as its prefix, the group of 2 shares 26.
    assert layout.tokens == 34 + (11 + 15 + 7 + 1) + 30 + 26 + (3 + 11)
    assert layout.tokens < pack(ids, att, PAD).tokens
    weights = torch.randn(int(keep.sum()), model.config.vocab_size, generator=g, dtype=torch.float64)
    shared = forward_cascade(model, layout, keep)
    (shared * weights).sin().sum().backward()
    got = _grads(model)
    alone = torch.cat([model(input_ids=r[None]).logits[0][keep[i, :len(r)]] for i, r in enumerate(rows)])
    (alone * weights).sin().sum().backward()
    want = _grads(model)
    assert float((shared - alone).detach().abs().max()) < (1e-12 if attention == "sdpa" else 1e-6)  # eager: fp32
    _close(got, want, rel=1e-6)


def test_padding_positions_stay_within_each_row_and_sliding_windows_fall_back_to_packing():
    """Padded suffix positions repeat the row's last position (a position beyond the longest row changes dynamic
    rotary scalings and overruns learned position tables); a sliding-window model is not cascaded: the explicit
    masks carry no window (review: wrong logits with two groups)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    rows = _rows()
    ids, att = _padded(rows)
    layout = cascade(ids, att, PAD, 16)
    lengths = att.sum(-1)
    assert int(layout.suffix_pos.max()) == int(lengths.max()) - 1
    config = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    assert supports_cascade(Qwen2ForCausalLM(Qwen2Config(**config)))
    windowed = Qwen2ForCausalLM(Qwen2Config(**config, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert not supports_cascade(windowed)
    trainer = Trainer(windowed, TrainConfig(optim=OptimConfig(lr=1e-3)), pad_id=PAD)
    assert trainer.shared_prefix == 0  # packed rows, one by one: exact with the window


def _group_batch(rows: list[torch.Tensor], prompt: int) -> Batch:
    """Sampled tokens after each row's prompt; the row that is only part of the prompt samples its last token."""
    ids, att = _padded(rows)
    shape = ids.shape
    loss = torch.zeros(shape)
    starts = [prompt] * 3 + [min(35, prompt) - 1, 10] + [prompt // 2] * 2
    for i, r in enumerate(rows):
        loss[i, starts[i]:len(r)] = 1.0
    g = torch.Generator().manual_seed(2)
    lps = -torch.rand(shape, generator=g) * 3
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.5, -0.25, 0.75])[:len(rows), None].expand(shape).clone()
    return Batch(ids, att, loss, lps, adv, torch.zeros(shape, dtype=torch.long), torch.ones(len(rows)), pad_id=PAD)


def _trainer(shared: int, **kw) -> Trainer:
    model = tiny_model(seed=1)[0].float()
    return Trainer(model, TrainConfig(optim=OptimConfig(lr=1e-3), shared_prefix=shared, micro_batch=8, **kw),
                   pad_id=PAD)


@pytest.mark.parametrize("aggregation, recompute", [("token_mean", False), ("seq_mean_token_mean", False),
                                                     ("token_mean", True)])
def test_micro_batch_loss_and_gradients_equal_per_sample(aggregation, recompute):
    """The trainer's micro-batch (policy loss, k3 KL to a frozen reference, hint distillation) with the prompt
    computed once vs every row computing it: the same loss and the same gradient for every parameter — also with
    activation checkpointing, whose recomputed layers must see the prefix's keys and values again."""
    from shipyard.train.losses import PolicyLossConfig

    batch = _group_batch(_rows(), prompt=40)
    batch.hints = [HintTarget(1, 38, (7, 8, 9), 40, 45), HintTarget(5, 20, (3,), 26, 29)]
    kw = dict(policy=PolicyLossConfig(aggregation=aggregation, kl_coef=0.1),
              distill=DistillConfig(enabled=True, weight=0.5, teacher="frozen"), activation_checkpointing=recompute)
    out = []
    for shared in (16, 0):
        trainer = _trainer(shared, **kw)
        sums: dict[str, float] = {}
        den = float(batch.size) if aggregation != "token_mean" else float((batch.loss_mask[:, 1:]).sum())
        dden = float(sum(h.end - h.start for h in batch.hints))
        trainer._micro(batch, den, dden, sums)
        out.append((sums, _grads(trainer.model)))
    (shared_sums, shared_grads), (row_sums, row_grads) = out
    assert shared_sums["forward_tokens"] < row_sums["forward_tokens"]
    for key in ("s:policy_loss", "s:distill_loss", "t:ref_kl", "t:entropy", "tokens"):
        assert shared_sums[key] == pytest.approx(row_sums[key], rel=1e-5, abs=1e-7), key
    _close(shared_grads, row_grads, rel=1e-4)


def test_unique_tokens_bound_micro_batches_and_the_step_cost():
    rows = _rows()
    ids, att = _padded(rows)
    lengths = att.sum(-1).tolist()
    # The group of 4 costs 35 + 30 unique tokens: it fits a 70-token budget as one micro-batch (170 tokens per row).
    plan = micro_batches(ids, lengths, max_rows=8, max_tokens=70, min_tokens=16)
    assert [0, 1, 2, 3] in plan and sorted(i for mb in plan for i in mb) == list(range(len(rows)))
    # A budget smaller than the group cuts it into chunks that each pay for the prompt once.
    cut = micro_batches(ids, lengths, max_rows=8, max_tokens=55, min_tokens=16)
    assert not any({0, 1, 2, 3} <= set(mb) for mb in cut)
    assert micro_batches(ids, lengths, max_rows=2, min_tokens=16)[0] != [0, 1, 2, 3]
    batch = _group_batch(rows, prompt=40)
    shared, alone = _trainer(16).step(batch), _trainer(0).step(batch)
    assert shared["forward_tokens"] == cascade(ids, att, PAD, 16).tokens
    assert alone["forward_tokens"] == sum(lengths)
    assert shared["policy_loss"] == pytest.approx(alone["policy_loss"], rel=1e-5)
    assert shared["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-4)


def _live_tensor_bytes() -> int:
    gc.collect()
    seen, total = set(), 0
    for o in gc.get_objects():
        if type(o) is torch.Tensor or type(o) is torch.nn.Parameter:
            storage = o.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_memory_is_flat_across_steps(optim):
    """Batches of other lengths every step: the tensors alive after step 8 take no more bytes than after step 2
    (optimizer state exists from step 1; nothing per step may stay behind — graphs, logits, caches, metrics)."""
    trainer = Trainer(tiny_model(seed=1)[0].float(), TrainConfig(optim=OptimConfig(name=optim, lr=1e-3)),
                      pad_id=PAD)
    sizes = []
    for step in range(8):
        trainer.step(_group_batch(_rows(seed=step, prompt=30 + 7 * step), prompt=30 + 7 * step))
        sizes.append(_live_tensor_bytes())
    batch_slack = 64 * 1024  # the batch of the latest step is still referenced by the loop
    assert max(sizes[2:]) <= sizes[1] + batch_slack, sizes


# The resident set is what glibc's heap rule is about, and only a process's resident set shows it: so each test below
# runs its steps in a child process that does nothing else (tests/own_memory.py), never in this one, whose resident
# set holds what other tests and their threads allocated, and arenas they freed.
HERE = Path(__file__).resolve().parent
CHILD = f"""
import json, sys
sys.path.insert(0, {str(HERE)!r})
import torch
from test_prefix import PAD, _group_batch, _rows
from shipyard.models.resolve import tiny_model
from shipyard.train.batch import Batch
from shipyard.train.memory import PeakRSS, resident_mb
from shipyard.train.trainer import TrainConfig, Trainer
"""

FLAT = CHILD + """
trainer = Trainer(tiny_model(seed=1, hidden=256, layers=4)[0], TrainConfig(), pad_id=PAD)
g = torch.Generator().manual_seed(0)
rss = []
for step in range(12):
    prompt = 200 + int(torch.randint(0, 1200, (1,), generator=g))
    trainer.step(_group_batch(_rows(seed=step, prompt=prompt), prompt=prompt))
    rss.append(resident_mb())
print(json.dumps(rss))
"""


def test_resident_memory_is_flat_across_steps():
    """Batches of other shapes every step: without handing freed heap pages back (malloc_trim), the resident memory
    grew from 451 to 977 MiB over 16 steps with no tensor alive; with it, it stays within 10 %."""
    rss = in_child(FLAT)
    assert max(rss[2:]) <= 1.1 * rss[1] + 16, [round(r) for r in rss]


STEP_PEAKS = CHILD + """
from own_memory import peak_mb, reset_peak
model, _ = tiny_model(seed=1, hidden=256, layers=4)
trainer = Trainer(model.float(), TrainConfig(activation_checkpointing=True), pad_id=PAD)

def peak(length):
    ids = torch.randint(3, 200, (1, length), generator=torch.Generator().manual_seed(length))
    loss = torch.zeros(1, length)
    loss[:, length - 50:] = 1.0
    batch = Batch(ids, torch.ones_like(ids), loss, torch.full(ids.shape, -1.0), torch.full(ids.shape, 0.5),
                  torch.zeros_like(ids), torch.ones(1), pad_id=PAD)
    base = reset_peak()  # the kernel's high-water mark from here: the step's exact peak, not a sampled one
    trainer.step(batch)
    return peak_mb() - base

print(json.dumps([peak(length) for length in map(int, sys.argv[1:])]))
"""


def test_a_steps_peak_follows_its_live_tensors_not_the_heap():
    """glibc's mmap threshold rises with every large block freed, so without `memory.step_heap` a step's activations
    come from the heap and its resident peak outgrows its live tensors. One row of L tokens, activation
    checkpointing, tiny model (hidden 256, 4 layers), peak above the resident set before the step, in a process that
    does only these steps: with the rule 190 MiB at L = 4,000 and 522 at 8,000; with only `malloc_trim` after each
    step (the rule before) 448 and 1,011 — as on the 0.5B, where it was +1.2 MB per token."""
    # the first step makes the optimizer's state
    _, short, long, short_after = in_child(STEP_PEAKS, "500", "500", "4000", "500")
    assert long < 290, "a 4,000-token step's peak outgrew its live tensors (heap)"
    assert short_after <= short * 1.2 + 8, "a short step after a long one peaked higher than before it"


PEAK_RSS = CHILD + """
import time
with PeakRSS(period=0.001) as p:
    before = resident_mb()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    deadline = time.monotonic() + 60
    while p.peak < before + 48 and time.monotonic() < deadline:  # the sampler may be starved on a busy machine
        time.sleep(0.01)
    del block
seen = p.peak
with p:  # reusable
    pass
print(json.dumps({"before": before, "seen": seen, "again": p.peak}))
"""


def test_peak_rss_sees_memory_freed_within_the_block():
    """`PeakRSS` (the library's sampler) in a process that does only this: it sees a 64 MiB block freed before the
    block ends, and a second use starts from the resident set then, not from the first use's peak."""
    figures = in_child(PEAK_RSS)
    assert figures["seen"] >= figures["before"] + 48, figures
    assert figures["again"] < figures["before"] + 48, figures
