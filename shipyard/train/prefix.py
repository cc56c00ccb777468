"""Shared prefixes: the prompt of a group is computed once per micro-batch, exactly.

GRPO samples N completions of one prompt, so the N rows of a group share their first P tokens (the prompt, and any
leading tokens the samples happen to agree on). Forwarding each row on its own computes those P positions N times:
for 8 samples of a 1.7k-token prompt with ~300 sampled tokens each, 16k positions where 4.1k are distinct.

Here the rows of a micro-batch are grouped by the ids themselves (`groups`: a row joins a group when it shares at
least `min_tokens` leading tokens with it; the group's prefix is the longest prefix common to all its rows), so
the result is right whatever order or mix of rows the caller passes. Each group is laid out as a tree in one packed
row: the prefix once, then each row's own tokens (its suffix), with position ids that continue at P in every
suffix, and a 4-D attention mask

    attend(i, j) = same tree(i, j) ∧ (branch(j) = prefix ∨ branch(j) = branch(i)) ∧ pos(j) ≤ pos(i)

so every token sees exactly the keys and values (same positions, so the same rotary phases) it sees in its own row,
and each logit equals the per-row logit up to float reassociation. Every row's prefix positions map to the same
packed positions (`Packed.index` repeats them), so the logits gathered for the loss reuse them and the backward
sums the prefix's gradient over the group's rows — the gradient of N separate forward passes, computed once
(tests/train/test_prefix.py checks the loss and every parameter gradient against the per-row computation). This is
the training-side counterpart of shared-prefix attention for inference (Hydragen, arXiv 2402.05099); the
difference is that gradients flow through the shared keys and values, which the single mask handles for free.

The layout needs an attention implementation that accepts a custom 4-D mask (transformers' `sdpa` and `eager`,
the CPU defaults). With another one (e.g. flash-attention kernels that only take packed position ids) rows are
packed one by one as before (`supports_tree`).

`micro_batches` plans a rank's rows by the same groups, counting *unique* tokens against `micro_batch_tokens`: a
group whose prefix plus suffixes fit the budget (and `max_rows`) runs as one micro-batch; a larger group is cut into
chunks that each pay for the prefix once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shipyard.train.packing import Packed, check_right_padded, first_fit_decreasing, pack


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


def supports_tree(model: nn.Module) -> bool:
    """Whether the model's attention takes a custom 4-D mask (the tree layout needs one)."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager")


def pack_shared(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int, min_tokens: int) -> Packed:
    """Right-padded rows packed with shared prefixes computed once (see the module docstring). Without a group of
    two or more rows (or with `min_tokens` 0) this is `packing.pack`: no 4-D mask at all."""
    lengths = attention_mask.sum(-1).tolist()
    found = groups(input_ids, lengths, min_tokens) if min_tokens > 0 else []
    if not any(len(g.rows) > 1 for g in found):
        return pack(input_ids, attention_mask, pad_id)
    check_right_padded(input_ids, attention_mask)
    costs = [g.cost(lengths) for g in found]
    capacity = max(costs)
    bins = first_fit_decreasing(costs, capacity)
    device = input_ids.device
    ids = torch.full((len(bins), capacity), pad_id, dtype=input_ids.dtype, device=device)
    pos = torch.zeros_like(ids)
    tree = torch.arange(ids.numel(), device=device).view(ids.shape) + len(found)  # padding: a tree of its own
    branch = torch.zeros_like(ids)
    index = torch.full_like(input_ids, -1)
    for r, members in enumerate(bins):
        at = 0
        for u in members:
            g = found[u]
            p = g.prefix
            first = g.rows[0]
            ids[r, at:at + p] = input_ids[first, :p]
            pos[r, at:at + p] = torch.arange(p, device=device)
            tree[r, at:at + p] = u
            start = r * capacity + at
            at += p
            for k, b in enumerate(g.rows, start=1):
                n = lengths[b] - p
                ids[r, at:at + n] = input_ids[b, p:lengths[b]]
                pos[r, at:at + n] = torch.arange(p, lengths[b], device=device)
                tree[r, at:at + n] = u
                branch[r, at:at + n] = k
                index[b, :p] = start + torch.arange(p, device=device)
                index[b, p:lengths[b]] = r * capacity + at + torch.arange(n, device=device)
                at += n
    same_tree = tree[:, :, None] == tree[:, None, :]
    visible = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
    causal = pos[:, None, :] <= pos[:, :, None]
    return Packed(ids, pos, index, (same_tree & visible & causal)[:, None])
