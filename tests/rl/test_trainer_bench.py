"""`shipyard bench trainer`'s arithmetic ceiling of computing a group's prompt once (`step_flops`), against hand
counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shipyard.bench.trainer import step_flops

ONE = SimpleNamespace(hidden_size=2, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                      intermediate_size=1, vocab_size=3)


def test_a_hand_counted_step():
    """hidden 2, one layer and head, MLP width 1, vocabulary 3; prompt 2, samples of 3 and 4 tokens (1 and 2
    sampled). Per position: q, k, v, o 4 × 2·2·2 = 32, MLP 3 × 2·2·1 = 12 → 44. Head: 2·2·3 = 12 per sampled token."""
    per_sample = 44 * 7 + 4 * 2 * (6 + 10) + 12 * 3  # causal pairs: 3 tokens 1+2+3, 4 tokens 1+2+3+4
    shared = 44 * 5 + 4 * 2 * (3 + 3 + (3 + 4)) + 12 * 3  # prompt 1+2; sample 1 sees 3; sample 2 sees 3, then 4
    assert step_flops(ONE, [3, 4], 2, shared=False) == per_sample
    assert step_flops(ONE, [3, 4], 2, shared=True) == shared


@pytest.mark.parametrize("lengths", [[2000], [1700, 1750, 2050]])
def test_the_ceiling_is_below_the_positions_ratio(lengths):
    """One sample gains nothing; otherwise the head at sampled positions and the samples' attention to the prompt
    cost the same either way, so the FLOPs ratio stays under the ratio of positions computed."""
    config = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                             intermediate_size=1536, vocab_size=49152)  # SmolLM2-135M's shapes
    ratio = step_flops(config, lengths, 1700, shared=False) / step_flops(config, lengths, 1700, shared=True)
    positions = sum(lengths) / (1700 + sum(n - 1700 for n in lengths))
    assert ratio == pytest.approx(1.0) if len(lengths) == 1 else 1.0 < ratio < positions
