"""KV caches for continuous batching: the running batch's cache (rows join and leave between decode steps) and the
prefix store (caches kept across an agent's turns and shared between prompts with a common prefix).

**The running batch.** Every running sequence is one row of a single `DynamicCache` whose layers hold keys and values
of shape `[rows, kv_heads, width, head_dim]` (transformers 5: `cache.layers[i].keys / .values`). Rows are
*right-aligned*: row i's `n_i` cached tokens fill the last `n_i` columns and the columns before them are padding,
masked out by the attention mask `column >= width - n_i`. Each decode step appends one column to every row, so the
alignment holds. Keys are stored after the rotary embedding was applied at their own position (the engine passes
explicit position ids: a row's next position is `n_i`, whatever the padding), so moving them to other columns changes
nothing about what they encode: a row attends to exactly the keys it would attend to alone, and padding only adds
masked (zero-weight) columns. When a sequence joins, every row is left-padded to the new common width; when
sequences leave, their rows are dropped and the columns no remaining row uses are cut (compaction), so a finished
long sequence stops costing attention for the others.

**The prefix store.** A finished sequence's cache (its prompt and the tokens fed after it) is kept under its session
(`GenerationRequest.session`), else under an anonymous key, as a batch-1 copy. A later prompt that starts with the
same tokens — the next turn of that agent (previous context + new tool output), a group sibling with the same prompt,
or any prompt sharing a long system prompt — starts from the longest cached common prefix and prefills only the rest.
The store is bounded in tokens; the least recently used entries go first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

# One sequence's cache: per layer (keys, values), each [1, kv_heads, tokens, head_dim].
KV = list[tuple[torch.Tensor, torch.Tensor]]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists (list slices compare in C: O(n log n), no Python loop
    over tokens)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def make_cache(kv: KV) -> DynamicCache:
    """A `DynamicCache` holding `kv` (the tensors are copied: the new cache never writes into `kv`'s storage)."""
    return DynamicCache(ddp_cache_data=[(k, v) for k, v in kv]) if kv else DynamicCache()


def cache_kv(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def prefix(kv: KV, n: int) -> KV:
    """The first `n` tokens of a batch-1 cache (views)."""
    return [(k[..., :n, :], v[..., :n, :]) for k, v in kv]


class RunningBatch:
    """The running sequences' cache: one row each, right-aligned (see the module docstring)."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.lengths: list[int] = []  # cached tokens per row

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.cache.layers[0].keys.shape[-2] if self.cache is not None else 0

    def next_mask(self, device: torch.device) -> torch.Tensor:
        """The attention mask for one more token per row: `[rows, width + 1]`, 1 on each row's real columns."""
        width = self.width + 1
        first = torch.tensor([width - 1 - n for n in self.lengths], device=device)[:, None]
        return (torch.arange(width, device=device)[None, :] >= first).long()

    def grew(self) -> None:
        """Record that a forward step appended one token to every row."""
        self.lengths = [n + 1 for n in self.lengths]

    def row(self, i: int) -> KV:
        """Row i's cached tokens as a batch-1 cache (views into the batch: clone to keep them)."""
        assert self.cache is not None
        start = self.width - self.lengths[i]
        return [(k[i:i + 1, :, start:, :], v[i:i + 1, :, start:, :]) for k, v in cache_kv(self.cache)]

    def add(self, rows: list[KV]) -> None:
        """Append sequences (batch-1 caches) as new rows; every row is left-padded to the new common width."""
        lengths = [kv[0][0].shape[-2] for kv in rows]
        width = max([self.width, *lengths])
        old = cache_kv(self.cache) if self.cache is not None else None
        layers = []
        for layer in range(len(rows[0])):
            parts_k, parts_v = [], []
            if old is not None:
                k, v = old[layer]
                parts_k.append(_left_pad(k, width))
                parts_v.append(_left_pad(v, width))
            for kv in rows:
                parts_k.append(_left_pad(kv[layer][0], width))
                parts_v.append(_left_pad(kv[layer][1], width))
            layers.append((torch.cat(parts_k), torch.cat(parts_v)))
        self.cache = make_cache(layers)
        self.lengths += lengths

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), and cut the columns no kept row uses."""
        if not rows:
            self.cache, self.lengths = None, []
            return
        assert self.cache is not None
        lengths = [self.lengths[i] for i in rows]
        start = self.width - max(lengths)
        index = torch.tensor(rows, device=self.cache.layers[0].keys.device)
        self.cache = make_cache([(k.index_select(0, index)[:, :, start:, :], v.index_select(0, index)[:, :, start:, :])
                                 for k, v in cache_kv(self.cache)])
        self.lengths = lengths


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    pad = width - t.shape[-2]
    return F.pad(t, (0, 0, pad, 0)) if pad else t


@dataclass
class Entry:
    ids: list[int]  # the tokens whose keys and values `kv` holds
    kv: KV


class PrefixStore:
    """Finished sequences' caches by key (a session, or an anonymous key), least recently used evicted first once
    more than `budget` tokens are held."""

    def __init__(self, budget: int):
        self.budget = budget
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.tokens = 0

    def put(self, key: str, ids: list[int], kv: KV) -> None:
        self.pop(key)
        if not ids or len(ids) > self.budget:
            return
        self.entries[key] = Entry(ids, [(k.clone(), v.clone()) for k, v in kv])  # never a view of a batch
        self.tokens += len(ids)
        while self.tokens > self.budget:
            _, old = self.entries.popitem(last=False)
            self.tokens -= len(old.ids)

    def pop(self, key: str) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.tokens -= len(entry.ids)
        return entry

    def best(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` (touched as recently used), and that length."""
        found, shared = None, 0
        for key, entry in self.entries.items():
            n = common_prefix(entry.ids, prompt)
            if n > shared:
                found, shared = key, n
        if found is None:
            return None, 0
        self.entries.move_to_end(found)
        return self.entries[found], shared

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
