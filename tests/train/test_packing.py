"""Packing: bins, layout, logits equal to the unpacked forward (dense and MoE), and the rank / micro-batch plans."""

import pytest
import torch

from shipyard.models.resolve import tiny_model
from shipyard.train.packing import balance, first_fit_decreasing, forward_kept, micro_batches, pack


def ragged(lengths, vocab=100, width=None, pad=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        att[i, :n] = 1
    return ids, att


def test_first_fit_decreasing_fills_rows_and_keeps_every_sequence():
    bins = first_fit_decreasing([5, 9, 3, 4, 1, 9], capacity=10)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum([5, 9, 3, 4, 1, 9][i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 9+1, 9, 5+4, 3
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([11], capacity=10)


def test_balance_splits_by_tokens_and_keeps_every_row():
    lengths = [900, 100, 120, 80, 500, 400, 60, 30]
    parts = balance(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) == 900 and sum(loads) == sum(lengths)  # the longest row alone is the best possible maximum
    assert all(p == sorted(p) for p in parts)
    assert balance(lengths, 3) == parts  # deterministic: every rank computes the same plan
    assert balance([5, 5], 4) == [[0], [1], [], []]  # more ranks than rows: some ranks get none


def test_micro_batches_bound_rows_and_tokens():
    lengths = [300, 50, 700, 1500, 200, 90, 10, 400]
    assert micro_batches(lengths, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    groups = micro_batches(lengths, 3, max_tokens=1000)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [3] in groups  # longer than the budget: alone, never split
    for g in groups:
        assert len(g) <= 3
        assert len(g) == 1 or sum(lengths[i] for i in g) <= 1000
    assert len(groups) == 4  # 1500 alone; the other 7 rows need at least 3 micro-batches of ≤ 3 rows: FFD uses 3


def test_pack_layout_round_trips_every_token():
    ids, att = ragged([7, 3, 5, 2, 7])
    p = pack(ids, att, pad_id=0)
    assert p.input_ids.shape[1] == 7
    assert p.padding == p.input_ids.numel() - 24
    flat = p.input_ids.flatten()
    assert torch.equal(flat[p.index[att.bool()]], ids[att.bool()])
    pos = p.position_ids.flatten()[p.index[att.bool()]]
    assert torch.equal(pos, (torch.cumsum(att, 1) - 1)[att.bool()])
    with pytest.raises(ValueError, match="right-padded"):
        pack(ids, att.flip(1), pad_id=0)


@pytest.mark.parametrize("moe", [False, True])
def test_packed_logits_equal_unpacked(moe):
    torch.manual_seed(0)
    if moe:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
            attn_implementation="sdpa"))
    else:
        model, _ = tiny_model(seed=1)
    model = model.float().eval()
    lengths = [11, 4, 6, 9, 2]
    ids, att = ragged(lengths, vocab=100)
    keep = att.bool().clone()
    keep[:, 0] = False
    packed = pack(ids, att, pad_id=0)
    assert packed.input_ids.shape[0] < len(lengths)  # something was actually packed together
    with torch.no_grad():
        got = forward_kept(model, packed, keep)
        want = torch.cat([model(input_ids=ids[i:i + 1, :n], use_cache=False).logits[0, 1:]
                          for i, n in enumerate(lengths)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="padding"):
        forward_kept(model, packed, torch.ones_like(keep))
