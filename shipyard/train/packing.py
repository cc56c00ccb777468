"""Sequence packing: the trainer's forward passes run on packed rows, so padding costs no compute.

RL batches are ragged: agent trajectories and completions end where the model stopped, and a right-padded
[B, T_max] batch spends `B·T_max − Σ L_b` positions of every matmul on padding (TRL pads each completion batch to
its longest completion). Here the sequences of a micro-batch are placed into rows of `capacity` tokens (default: the
longest sequence, so no sequence is ever split) by first-fit decreasing, which packs within 11/9·OPT + 6/9 rows
(Dósa 2007). Each row carries position ids that restart at 0 for every sequence; called with
`attention_mask=None`, transformers turns restarting position ids into a block-diagonal causal mask
(`masking_utils.find_packed_sequence_indices`), so no token attends across sequences and each sequence's
logits equal its unpacked logits up to float rounding (tested).

`forward_kept` returns the logits only at the requested positions of the original [B, T] layout, flattened in
its row-major order — the output head and the vocabulary log-softmax never see prompts, observations or padding.

Scheduling the rows of a step. Agent trajectories range from a few hundred to tens of thousands of tokens, so the
rows of a batch are placed by tokens, not by count:
- `balance` splits the batch over data-parallel ranks by longest-processing-time first (each row, longest first, to
  the rank with the fewest tokens so far), within 4/3 of the best possible maximum load (Graham 1969); every rank
  computes the same plan from the same batch, so no communication is needed and any batch size fits any world size;
- `micro_batches` groups a rank's rows into micro-batches of at most `max_rows` rows and, when a token budget is
  set, at most `max_tokens` tokens (first-fit decreasing again), which bounds activation memory by tokens. A row
  longer than the budget gets a micro-batch of its own: a sequence is never split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Packed:
    input_ids: torch.Tensor  # [R, C] long, pad_id after the last sequence of a row
    position_ids: torch.Tensor  # [R, C] long, 0 at the start of every sequence (and of the trailing padding)
    index: torch.Tensor  # [B, T] long: flat position in [R·C] of each original token, −1 for padding
    # [R, 1, C, C] bool, True where query i may attend key j (block-diagonal causal), for calls that pass a key/value
    # cache, where transformers does not derive it from restarting position ids (`prefix.cascade`); None: they say it.
    mask: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """Positions of the packed rows that hold a token (a shared prefix counts once)."""
        return int(self.index[self.index >= 0].unique().numel())

    @property
    def padding(self) -> int:
        """Positions of the packed rows that hold no token."""
        return self.input_ids.numel() - self.tokens


def first_fit_decreasing(lengths: list[int], capacity: int, max_items: int | None = None) -> list[list[int]]:
    """Bins of sequence indices whose lengths sum to at most `capacity` (and of at most `max_items` indices),
    longest sequences placed first."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit a packed row of {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free and (max_items is None or len(bins[b]) < max_items):
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def balance(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices split into `parts` lists of nearly equal token sums (longest first to the least-loaded part, ties to
    the lowest part); each list in ascending order. Deterministic: equal inputs give equal plans on every rank."""
    load = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        p = min(range(parts), key=lambda p: (load[p], p))
        out[p].append(i)
        load[p] += lengths[i]
    return [sorted(o) for o in out]


def micro_batches(lengths: list[int], max_rows: int, max_tokens: int = 0) -> list[list[int]]:
    """Indices grouped into micro-batches of at most `max_rows` and, if `max_tokens` > 0, at most `max_tokens`
    tokens (a longer sequence alone). Without a token budget: consecutive runs of `max_rows`, in order."""
    if not max_tokens:
        return [list(range(i, min(i + max_rows, len(lengths)))) for i in range(0, len(lengths), max_rows)]
    alone = [[i] for i, n in enumerate(lengths) if n > max_tokens]
    rest = [i for i, n in enumerate(lengths) if n <= max_tokens]
    bins = first_fit_decreasing([lengths[i] for i in rest], max_tokens, max_rows)
    return alone + [sorted(rest[j] for j in b) for b in bins]


def check_right_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if not torch.equal(attention_mask.bool(), torch.arange(input_ids.shape[1], device=input_ids.device)
                       < attention_mask.sum(-1, keepdim=True)):
        raise ValueError("packing needs right-padded rows: attention_mask must be 1 on a prefix of each row")


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int, capacity: int | None = None) -> Packed:
    """Pack right-padded rows (`attention_mask` 1 on a prefix of each row) into rows of `capacity` tokens."""
    lengths = attention_mask.sum(-1).tolist()
    check_right_padded(input_ids, attention_mask)
    capacity = capacity or max(max(lengths), 1)
    bins = first_fit_decreasing(lengths, capacity)
    ids = torch.full((len(bins), capacity), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    pos = torch.zeros_like(ids)
    index = torch.full_like(input_ids, -1)
    for r, members in enumerate(bins):
        at = 0
        for i in members:
            n = lengths[i]
            ids[r, at:at + n] = input_ids[i, :n]
            pos[r, at:at + n] = torch.arange(n, device=ids.device)
            index[i, :n] = r * capacity + at + torch.arange(n, device=ids.device)
            at += n
        pos[r, at:] = torch.arange(capacity - at, device=ids.device)
    return Packed(ids, pos, index)


def forward_kept(model: nn.Module, packed: Packed, keep: torch.Tensor, cache=None) -> torch.Tensor:
    """Logits [N, V] at the True positions of `keep` ([B, T], over real tokens), in `keep`'s row-major order. Rows
    sharing a packed position get the same logits there (gathered twice, so their gradients add up). `cache`: a
    transformers key/value cache the call writes into (`prefix.forward_cascade`)."""
    where = packed.index[keep]
    if bool((where < 0).any()):
        raise ValueError("logits requested at a padding position")
    computed = where.unique()  # sorted
    flat = torch.zeros(packed.input_ids.numel(), dtype=torch.bool, device=keep.device)
    flat[computed] = True
    mask = packed.mask
    if mask is not None and model.config._attn_implementation == "eager":  # eager adds the mask to the scores
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, float("-inf"))
    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=mask, cache=cache,
                   use_cache=False, logits_to_keep=flat.view(packed.input_ids.shape)).logits
    # The model returns the kept positions in packed row-major order; put them back in the original order.
    return logits[torch.searchsorted(computed, where)]
