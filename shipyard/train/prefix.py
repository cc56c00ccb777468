"""Shared prefixes: the prompt of a group is computed once per micro-batch, exactly.

GRPO samples N completions of one prompt, so the N rows of a group share their first P tokens (the prompt, and any
leading tokens the samples happen to agree on). Forwarding each row on its own computes those P positions N times:
for 8 samples of a 1.7k-token prompt with ~300 sampled tokens each, 16k positions where 4.1k are distinct.

Here the rows of a micro-batch are grouped by the ids themselves (`groups`: a row joins a group when it shares at
least `min_tokens` leading tokens with it; the group's prefix is the longest prefix common to all its rows), so
the result is right whatever order or mix of rows the caller passes. The micro-batch is then computed in two model
calls, a cascade (`cascade`, `forward_cascade`):

1. **the prefixes**: each group's prefix once, packed in one row (position ids restarting per prefix; with more
   than one prefix, a block-diagonal causal mask), its keys and values captured per layer;
2. **the suffixes**: every row's own tokens (after its group's prefix) as a batch row, position ids continuing at
   P, attending through a key/value cache to its group's prefix keys and values (gathered from the first call; the
   gather's backward sums each row's gradient into them) and causally to its own suffix.

Every token sees exactly the keys and values (same positions, so the same rotary phases) it sees in its own row,
so each logit equals the per-row logit up to float reassociation, and the backward through the gathered keys and
values sums the prefix's gradient over the group's rows — the gradient of N separate forward passes, computed once
(tests/train/test_prefix.py checks the logits, the loss and every parameter gradient against the per-row
computation). Logits at kept prefix positions (sampled tokens all rows agree on) are gathered for each row that
keeps them. This is the training-side counterpart of shared-prefix attention for inference (Hydragen, arXiv
2402.05099; cascade inference); the difference is that gradients flow through the shared keys and values.

Why two calls and not one packed row with a tree-shaped 4-D mask (the first version): a CPU attention kernel under
a custom mask computes every block of the packed row, so 8 suffixes of 300 tokens after a 1.7k prompt cost
4.1k² = 16.8M scores — more than the 8 × 2k²/2 = 16M of computing each row alone; here the prefix is causal
(1.7k²/2) and the suffixes cost 8 × 300 × 2k = 4.8M. Every row keeps at least one token of its own (a group's
prefix stops one short of its shortest row; a row of its own has a one-token prefix), so both calls always run —
on every rank, as FSDP's collectives need. The caches used are stateless across a layer's calls (`_Capture`,
`_Prefixed`), so activation checkpointing may recompute a layer (the trainer's own per-layer checkpointing;
transformers' drops caches inside checkpointed layers).

Known costs (review, not yet addressed): the suffix call is a padded batch, B × (widest prefix + longest suffix)
positions, while `micro_batches` and `forward_tokens` count unique tokens — a lone 2k-token row in a micro-batch with
a group of short suffixes pads every suffix to 2k (bucketing suffixes by length would fix it); the gathered
prefix keys and values of every layer are built up front and kept to the backward under activation checkpointing
(gathering inside the cache's `update` would recompute them per layer); under FSDP2 each layer is gathered twice per
micro-batch (two calls); several prefixes in one row attend under an explicit mask (no causal fast path).

The cascade needs an attention implementation that takes a key/value cache with a 2-D padding mask (transformers'
`sdpa` and `eager`, the CPU defaults: `supports_cascade`); with another, rows are packed one by one.

`micro_batches` plans a rank's rows by the same groups, counting *unique* tokens against `micro_batch_tokens`: a
group whose prefix plus suffixes fit the budget (and `max_rows`) runs as one micro-batch; a larger group is cut into
chunks that each pay for the prefix once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from shipyard.train.packing import Packed, check_right_padded, forward_kept, pack


@dataclass(frozen=True)
class Group:
    rows: tuple[int, ...]
    prefix: int  # leading tokens shared by every row of the group (0 for a row of its own)

    def cost(self, lengths: list[int]) -> int:
        """Distinct positions: the prefix once, then each row's own tokens."""
        return self.prefix + sum(lengths[b] - self.prefix for b in self.rows)


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D id tensors."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


def groups(input_ids: torch.Tensor, lengths: list[int], min_tokens: int) -> list[Group]:
    """Rows grouped by shared leading tokens, in order of first row: each row joins the first group whose current
    prefix it shares for at least `min_tokens` tokens (the group's prefix shrinks to the common part), else starts
    a group. `min_tokens` 0: every row on its own."""
    found: list[tuple[list[int], int]] = []
    for b, n in enumerate(lengths):
        row = input_ids[b, :n]
        for i, (rows, prefix) in enumerate(found if min_tokens > 0 else []):
            p = common_prefix(row, input_ids[rows[0], :prefix])
            if p >= min_tokens:
                rows.append(b)
                found[i] = (rows, p)
                break
        else:
            found.append(([b], n))
    return [Group(tuple(rows), prefix if len(rows) > 1 else 0) for rows, prefix in found]


def micro_batches(input_ids: torch.Tensor, lengths: list[int], max_rows: int, max_tokens: int = 0,
                  min_tokens: int = 0) -> list[list[int]]:
    """Row indices in micro-batches of at most `max_rows` rows and, with `max_tokens` > 0, at most that many unique
    tokens (a group's prefix counted once; a row longer than the budget runs alone). A group's rows stay together
    while they fit; micro-batches are filled first-fit decreasing by unique tokens. Deterministic: every rank
    computes the same plan from the same batch."""
    chunks: list[tuple[list[int], int]] = []
    for g in groups(input_ids, lengths, min_tokens):
        rows: list[int] = []
        cost = 0
        for b in g.rows:
            add = lengths[b] - g.prefix + (0 if rows else g.prefix)
            if rows and (len(rows) >= max_rows or (max_tokens and cost + add > max_tokens)):
                chunks.append((rows, cost))
                rows, cost, add = [], 0, lengths[b]
            rows.append(b)
            cost += add
        chunks.append((rows, cost))
    bins: list[tuple[list[int], int]] = []
    for rows, cost in sorted(chunks, key=lambda c: (-c[1], c[0][0])):
        for i, (have, used) in enumerate(bins):
            if len(have) + len(rows) <= max_rows and (not max_tokens or used + cost <= max_tokens):
                bins[i] = (have + rows, used + cost)
                break
        else:
            bins.append((list(rows), cost))
    return [sorted(rows) for rows, _ in bins]


def supports_cascade(model: nn.Module) -> bool:
    """Whether the cascade is exact for this model: attention that takes a key/value cache with a 2-D padding mask
    (transformers' `sdpa` and `eager`, the CPU defaults) and no sliding window (the explicit masks here carry no
    window, and a window counted in cache columns would be off for rows with shorter prefixes). Otherwise rows are
    packed one by one (`packing.pack`)."""
    config = model.config
    sliding = getattr(config, "sliding_window", None) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                                 or ())
    return getattr(config, "_attn_implementation", None) in ("sdpa", "eager") and not sliding


class _Capture(DynamicCache):
    """Records each layer's keys and values of the prefix call. Stateless across calls of a layer: a forward
    recomputed for the backward (activation checkpointing) replaces the record instead of extending it."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kv[layer_idx] = (key_states, value_states)
        return key_states, value_states


class _Prefixed(DynamicCache):
    """The prefix keys and values each suffix row attends to; `update` returns prefix + new and stores nothing, so
    a recomputed forward sees the same cache."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        return torch.cat([layer.keys, key_states], -2), torch.cat([layer.values, value_states], -2)


@dataclass
class Cascade:
    """A micro-batch as two model calls (module docstring): the groups' prefixes packed in one row, then every row's
    suffix as a batch row attending to its group's prefix keys and values."""

    prefix: Packed  # [1, C]: each group's prefix once, position ids restarting per prefix
    suffix_ids: torch.Tensor  # [B, S] the row's tokens after its group's prefix, right-padded
    suffix_pos: torch.Tensor  # [B, S] positions continuing after the prefix
    suffix_mask: torch.Tensor  # [B, P + S] 1 on the row's prefix columns (left-aligned) and its suffix tokens
    kv_index: torch.Tensor  # [B, P] the packed prefix column of each cache column (0 where masked)
    index: torch.Tensor  # [B, T] flat position of each token: prefix columns [0, C), then suffix B·S; −1 padding

    @property
    def tokens(self) -> int:
        """Positions computed: each prefix once, then each row's own tokens."""
        return int(self.index[self.index >= 0].unique().numel())


def cascade(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int, min_tokens: int) -> Cascade:
    """The two-call layout of right-padded rows (module docstring). Every row keeps at least one token after its
    prefix (a group's prefix stops one short of its shortest row; a row of its own has a one-token prefix), so both
    calls always run — on every rank, as FSDP needs."""
    check_right_padded(input_ids, attention_mask)
    lengths = attention_mask.sum(-1).tolist()
    if min(lengths) < 2:
        raise ValueError("the shared-prefix layout needs rows of at least 2 tokens")
    device = input_ids.device
    found = groups(input_ids, lengths, min_tokens)
    splits = [max(1, min(g.prefix if len(g.rows) > 1 else 1, min(lengths[b] for b in g.rows) - 1)) for g in found]
    width = sum(splits)
    prefix_ids = torch.cat([input_ids[g.rows[0], :p] for g, p in zip(found, splits, strict=True)])[None]
    prefix_pos = torch.cat([torch.arange(p, device=device) for p in splits])[None]
    batch, wide = input_ids.shape[0], max(splits)
    longest = max(lengths[b] - p for g, p in zip(found, splits, strict=True) for b in g.rows)
    suffix_ids = torch.full((batch, longest), pad_id, dtype=input_ids.dtype, device=device)
    suffix_pos = torch.zeros_like(suffix_ids)
    suffix_mask = torch.zeros(batch, wide + longest, dtype=torch.long, device=device)
    kv_index = torch.zeros(batch, wide, dtype=torch.long, device=device)
    index = torch.full_like(input_ids, -1)
    offset = 0
    for g, p in zip(found, splits, strict=True):
        columns = offset + torch.arange(p, device=device)
        for b in g.rows:
            n = lengths[b] - p
            suffix_ids[b, :n] = input_ids[b, p:lengths[b]]
            # Padding repeats the last real position: no position id beyond the row's own (rotary scalings that
            # depend on the largest position, learned position tables).
            suffix_pos[b] = p + torch.arange(longest, device=device).clamp(max=n - 1)
            suffix_mask[b, :p] = 1
            suffix_mask[b, wide:wide + n] = 1
            kv_index[b, :p] = columns
            index[b, :p] = columns
            index[b, p:lengths[b]] = width + b * longest + torch.arange(n, device=device)
        offset += p
    mask = None
    if len(found) > 1:  # several prefixes in one row: block-diagonal causal (a cache-writing call needs it explicit)
        owner = torch.repeat_interleave(torch.arange(len(found), device=device), torch.tensor(splits, device=device))
        mask = ((owner[:, None] == owner[None, :]) & (prefix_pos[0][None, :] <= prefix_pos[0][:, None]))[None, None]
    prefix = Packed(prefix_ids, prefix_pos, torch.arange(width, device=device)[None], mask)
    return Cascade(prefix, suffix_ids, suffix_pos, suffix_mask, kv_index, index)


def forward_cascade(model: nn.Module, layout: Cascade, keep: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] at the True positions of `keep` ([B, T], over real tokens), in `keep`'s row-major order — as
    `packing.forward_kept`, with each group's prefix computed once (its logits gathered for every row that keeps
    them, so their gradients add up)."""
    where = layout.index[keep]
    if bool((where < 0).any()):
        raise ValueError("logits requested at a padding position")
    computed = where.unique()  # sorted: prefix positions first
    width = layout.prefix.input_ids.shape[1]
    batch, longest = layout.suffix_ids.shape
    first = torch.zeros(1, width, dtype=torch.bool, device=keep.device)
    first[0, computed[computed < width]] = True
    second = torch.zeros(batch * longest, dtype=torch.bool, device=keep.device)
    second[computed[computed >= width] - width] = True
    captured = _Capture()
    head = forward_kept(model, layout.prefix, first, cache=captured)
    columns = layout.kv_index.view(-1)
    rows = []
    for i in range(len(captured.kv)):
        k, v = captured.kv[i]  # [1, heads, C, dim]
        rows.append(tuple(t.index_select(2, columns).view(t.shape[1], batch, -1, t.shape[3]).transpose(0, 1)
                          for t in (k, v)))
    tail = model(input_ids=layout.suffix_ids, position_ids=layout.suffix_pos, attention_mask=layout.suffix_mask,
                 cache=_Prefixed(ddp_cache_data=rows), use_cache=False,
                 logits_to_keep=second.view(batch, longest)).logits
    return torch.cat([head, tail])[torch.searchsorted(computed, where)]


def layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int, min_tokens: int) -> Packed | Cascade:
    """How a micro-batch is computed: the cascade when rows may share prefixes (`min_tokens` > 0), else packed rows
    (`packing.pack`: one call, no sharing)."""
    if min_tokens > 0:
        return cascade(input_ids, attention_mask, pad_id, min_tokens)
    return pack(input_ids, attention_mask, pad_id)


def forward_layout(model: nn.Module, computed: Packed | Cascade, keep: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] at `keep`'s True positions, in its row-major order, for either layout."""
    if isinstance(computed, Cascade):
        return forward_cascade(model, computed, keep)
    return forward_kept(model, computed, keep)
