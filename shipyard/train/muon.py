"""Muon: momentum orthogonalized by Newton–Schulz, per attention head and per expert, sharded across ranks.

For a matrix parameter W with gradient G (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/; Liu et
al. 2025, "Muon is Scalable for LLM Training", arXiv 2502.16982):

    B ← μ B + (1 − μ) G                         momentum (as torch.optim.Muon: an EMA, `lerp`)
    U ← (1 − μ) G + μ B                         Nesterov look-ahead
    O ← NS₅(U)                                  ≈ the orthogonal factor of U's polar decomposition (U = O P)
    W ← W (1 − η λ)                             decoupled weight decay
    W ← W − η · 0.2 √max(r, c) · O              the 0.2√max(r,c) factor gives O the RMS of an AdamW update,
                                                so AdamW's learning rate and weight decay carry over

NS₅ is five steps of the quintic Newton–Schulz iteration X ← aX + (bA + cA²)X with A = XXᵀ and (a, b, c) =
(3.4445, −4.7750, 2.0315), in bfloat16, after scaling X = U/‖U‖_F (so every singular value is ≤ 1; the wide
orientation keeps A small). These coefficients push singular values into roughly [0.7, 1.2] in 5 steps rather
than converging exactly — which is all the optimizer needs.

**Units.** Orthogonalization applies to *units*: a whole matrix by default, but the query/key/value projections
are orthogonalized per attention head (rows [h·d, (h+1)·d) of q_proj: each head is its own linear map) and stacked
expert weights [E, r, c] per expert. A parameter is viewed as a matrix of N rows; a unit is a block of `unit_rows`
consecutive rows; the 0.2√max(r, c) scale uses the unit's shape.

**Sharding.** Under FSDP2 each rank holds a contiguous block of rows of every parameter (`Shard(0)`; torch.chunk
sizes). The momentum update is elementwise and runs on the local rows. A unit wholly inside one rank's rows is
orthogonalized there with no communication. A unit split across ranks gets an owner among the ranks holding its
rows, chosen to balance the Newton–Schulz work over ranks (`plan_owners`); the other holders send their rows to it
in one all-to-all for all split units of the step, the owner runs Newton–Schulz once, and a second all-to-all
returns each holder its rows of the result. The local units are orthogonalized while the first all-to-all is in
flight — units of one shape in one batched Newton–Schulz call (a model's hundreds of attention heads become a few
large matmuls) — and their updates applied, one call per parameter, while the second is. Every unit is computed
by the same function on the same values whatever the world size, and on CPU a batched call gives each unit bitwise
its unbatched result, so 1, 2 and 4 ranks give bitwise-identical parameters (on GPUs, batched and single matmuls
may take different cuBLAS kernels: equal to rounding). Parameters that are not
DTensors are whole on every rank (world size 1, or replicated): every unit is local.

AdamW handles what is not a matrix of a linear map — embeddings, the output head, norms, biases —
(`muon_param_groups` splits a model's parameters by name, each matched exactly once).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


NS_BATCH_ELEMENTS = 1 << 24  # units of one shape are orthogonalized together, up to this many elements per call


def newton_schulz(g: Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7) -> Tensor:
    """The orthogonalized unit (bfloat16) of `g` [r, c], or of each unit of a batch [B, r, c], each computed as
    torch.optim.Muon does (on CPU a batch gives bitwise the per-unit results: tested)."""
    a, b, c = coefficients
    x = g.bfloat16().reshape(-1, *g.shape[-2:])
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).reshape(g.shape)


def batched_newton_schulz(units: list[tuple[Tensor, dict]]) -> list[Tensor]:
    """Newton–Schulz of every (unit, param group) pair. Units of one shape and the same settings go through one
    batched call (chunks of at most `NS_BATCH_ELEMENTS` elements), so the hundreds of per-head units of a model
    cost a few large matmuls rather than thousands of small ones (kernel launches, on a GPU)."""
    out: dict[int, Tensor] = {}
    buckets: dict[tuple, list[int]] = {}
    for i, (u, group) in enumerate(units):
        key = (tuple(u.shape), group["ns_steps"], tuple(group["ns_coefficients"]), group["eps"])
        buckets.setdefault(key, []).append(i)
    for (shape, steps, coefficients, eps), index in buckets.items():
        per = max(1, NS_BATCH_ELEMENTS // math.prod(shape))
        for s in range(0, len(index), per):
            chunk = index[s:s + per]
            o = newton_schulz(torch.stack([units[i][0] for i in chunk]), steps, coefficients, eps)
            out.update(zip(chunk, o, strict=True))
    return [out[i] for i in range(len(units))]


def update_scale(rows: int, cols: int) -> float:
    return 0.2 * math.sqrt(max(rows, cols))


@dataclass(frozen=True)
class _Layout:
    """Where a parameter's rows live: the [N, C] matrix view, this rank's rows [lo, hi), every rank's ranges."""

    n: int
    cols: int
    unit_rows: int
    ranges: tuple[tuple[int, int], ...]
    rank: int

    @property
    def lo(self) -> int:
        return self.ranges[self.rank][0]

    @property
    def hi(self) -> int:
        return self.ranges[self.rank][1]

    def holders(self, unit: int) -> list[tuple[int, int, int]]:
        """(rank, first row, end row) of each piece of `unit`, in row order."""
        u0, u1 = unit * self.unit_rows, (unit + 1) * self.unit_rows
        return [(r, max(u0, lo), min(u1, hi)) for r, (lo, hi) in enumerate(self.ranges) if max(u0, lo) < min(u1, hi)]



def _cost(rows: int, cols: int) -> int:
    """Relative cost of Newton–Schulz on a rows × cols unit (its matmuls are m·m·n with m = min, n = max)."""
    return min(rows, cols) ** 2 * max(rows, cols)


def plan_owners(layouts: list[_Layout], world: int) -> dict[tuple[int, int], int]:
    """Owner rank of every split unit, balancing Newton–Schulz work: each rank starts with its whole units' cost;
    split units, largest first, go to the least-loaded rank holding a piece (then the biggest piece, lowest rank).
    Every rank computes the same plan from the same layouts."""
    load = [0] * world
    split = []
    for w, lay in enumerate(layouts):
        for unit in range(lay.n // lay.unit_rows):
            pieces = lay.holders(unit)
            if len(pieces) == 1:
                load[pieces[0][0]] += _cost(lay.unit_rows, lay.cols)
            else:
                split.append((w, unit, pieces))
    owners = {}
    for w, unit, pieces in sorted(split, key=lambda s: -_cost(layouts[s[0]].unit_rows, layouts[s[0]].cols)):
        rank = min(pieces, key=lambda p: (load[p[0]], -(p[2] - p[1]), p[0]))[0]
        owners[(w, unit)] = rank
        load[rank] += _cost(layouts[w].unit_rows, layouts[w].cols)
    return owners


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _layout(p: Tensor, unit_rows: int | None) -> tuple[_Layout, dist.ProcessGroup | None]:
    shape = p.shape
    if p.ndim == 3:  # stacked experts [E, r, c]: one unit per expert unless told otherwise
        n, cols, default = shape[0] * shape[1], shape[2], shape[1]
        rows_per_index = shape[1]
    elif p.ndim == 2:
        n, cols, default, rows_per_index = shape[0], shape[1], shape[0], 1
    else:
        raise ValueError(f"Muon takes 2-D matrices and 3-D stacked experts, not a {p.ndim}-D parameter of shape "
                         f"{tuple(shape)}: give it to AdamW")
    unit = unit_rows or default
    if n % unit:
        raise ValueError(f"a parameter of shape {tuple(shape)} does not split into units of {unit} rows")
    if not isinstance(p, DTensor):
        return _Layout(n, cols, unit, ((0, n),), 0), None
    mesh = p.device_mesh
    if mesh.ndim != 1 or p.placements != (Shard(0),):
        raise ValueError(f"Muon supports parameters sharded on dim 0 over a 1-D mesh (FSDP2); got {p.placements}")
    world, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-shape[0] // world)
    ranges = tuple((min(k * chunk, shape[0]) * rows_per_index, min((k + 1) * chunk, shape[0]) * rows_per_index)
                   for k in range(world))
    layout = _Layout(n, cols, unit, ranges, rank)
    local_rows = _local(p).numel() // cols if cols else 0
    if local_rows != layout.hi - layout.lo:
        raise RuntimeError(f"unexpected shard of {tuple(shape)} on rank {rank}: {local_rows} rows, expected "
                           f"{layout.hi - layout.lo} (torch.chunk layout)")
    return layout, mesh.get_group()


class Muon(torch.optim.Optimizer):
    """Muon over 2-D matrices and 3-D stacked experts (plain tensors or FSDP2 DTensors sharded on dim 0).

    Takes a list of parameters, like `torch.optim.Muon`, or param groups; a group's `unit_rows` sets the rows per
    orthogonalization unit (e.g. the head dim for q/k/v projections; default: the whole matrix, or one expert).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 ns_steps: int = 5, eps: float = 1e-7):
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr >= 0, weight_decay >= 0, 0 <= momentum < 1; got {lr}, {weight_decay}, "
                             f"{momentum}")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": ns_coefficients, "ns_steps": ns_steps, "eps": eps, "unit_rows": None}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                _layout(p, group["unit_rows"])  # refuse bad shapes now, not at the first step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (param, group, layout, local update [rows, C])
        group_pg = None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                layout, pg = _layout(p, group["unit_rows"])
                group_pg = pg if pg is not None else group_pg
                grad = _local(p.grad).reshape(-1, layout.cols)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                work.append((p, group, layout, update))
        self._orthogonalize_and_apply(work, group_pg)
        return loss

    def _ns(self, u: Tensor, group: dict) -> Tensor:
        return newton_schulz(u, group["ns_steps"], group["ns_coefficients"], group["eps"])

    def _orthogonalize_and_apply(self, work: list, pg: dist.ProcessGroup | None) -> None:
        world = dist.get_world_size(pg) if pg is not None else 1
        rank = dist.get_rank(pg) if pg is not None else 0
        owners = plan_owners([lay for _, _, lay, _ in work], world)
        # Plan: which split units this rank sends (to their owner) and receives (as owner), in a fixed order.
        send: list[list[Tensor]] = [[] for _ in range(world)]
        recv_sizes = [0] * world
        owned: list[tuple[int, int]] = []  # (work index, unit) this rank orthogonalizes for others
        local: list[tuple[int, int]] = []  # (work index, unit) whole on this rank
        returned: list[tuple[int, int]] = []  # (work index, unit) split units this rank holds a piece of
        for w, (_, _, lay, upd) in enumerate(work):
            for unit in range(lay.n // lay.unit_rows):
                pieces = lay.holders(unit)
                mine = [pc for pc in pieces if pc[0] == rank]
                if len(pieces) == 1:
                    if mine:
                        local.append((w, unit))
                    continue
                owner = owners[(w, unit)]
                if mine:
                    returned.append((w, unit))
                    if owner != rank:
                        _, a, b = mine[0]
                        send[owner].append(upd[a - lay.lo:b - lay.lo].float().reshape(-1))
                if owner == rank:
                    owned.append((w, unit))
                    for r, a, b in pieces:
                        if r != rank:
                            recv_sizes[r] += (b - a) * lay.cols
        split = pg is not None and any(len(lay.holders(u)) > 1 for _, _, lay, _ in work
                                       for u in range(lay.n // lay.unit_rows))
        inbox, handle = None, None
        if split:
            out = torch.cat([t for s in send for t in s]) if any(send) else torch.empty(0)
            inbox = torch.empty(sum(recv_sizes))
            handle = dist.all_to_all_single(inbox, out, recv_sizes, [sum(t.numel() for t in s) for s in send],
                                            group=pg, async_op=True)
        # Whole units, batched by shape, while the first all-to-all is in flight.
        units = []
        for w, unit in local:
            _, group, lay, upd = work[w]
            a = unit * lay.unit_rows - lay.lo
            units.append((upd[a:a + lay.unit_rows], group))
        results = dict(zip(local, batched_newton_schulz(units), strict=True))
        if split:
            handle.wait()
            offsets = [sum(recv_sizes[:r]) for r in range(world)]
            back: list[list[Tensor]] = [[] for _ in range(world)]
            for w, unit in owned:
                _, group, lay, upd = work[w]
                rows = []
                for r, a, b in lay.holders(unit):
                    if r == rank:
                        rows.append(upd[a - lay.lo:b - lay.lo].float())
                    else:
                        size = (b - a) * lay.cols
                        rows.append(inbox[offsets[r]:offsets[r] + size].view(b - a, lay.cols))
                        offsets[r] += size
                full = self._ns(torch.cat(rows), group)
                u0 = unit * lay.unit_rows
                for r, a, b in lay.holders(unit):
                    if r == rank:
                        results[(w, unit)] = full[a - u0:b - u0]
                    else:
                        back[r].append(full[a - u0:b - u0].float().reshape(-1))
            back_sizes = [sum(t.numel() for t in s) for s in back]
            expect = [0] * world
            for w, unit in returned:
                lay = work[w][2]
                owner = owners[(w, unit)]
                if owner != rank:
                    (_, a, b), = [pc for pc in lay.holders(unit) if pc[0] == rank]
                    expect[owner] += (b - a) * lay.cols
            inbox2 = torch.empty(sum(expect))
            out2 = torch.cat([t for s in back for t in s]) if any(back) else torch.empty(0)
            handle = dist.all_to_all_single(inbox2, out2, expect, back_sizes, group=pg, async_op=True)
        # Whole units' updates, overlapped with the second all-to-all: a parameter's whole units on this rank are
        # consecutive rows, so each parameter gets one update over all of them.
        by_param: dict[int, list[int]] = {}
        for w, unit in local:
            by_param.setdefault(w, []).append(unit)
        for w, unit_list in by_param.items():
            self._apply(work[w], unit_list[0], torch.cat([results[(w, u)] for u in unit_list]))
        if split:
            handle.wait()
            offsets = [sum(expect[:r]) for r in range(world)]
            for w, unit in returned:
                lay = work[w][2]
                owner = owners[(w, unit)]
                (_, a, b), = [pc for pc in lay.holders(unit) if pc[0] == rank]
                if owner == rank:
                    o = results[(w, unit)]
                else:
                    size = (b - a) * lay.cols
                    o = inbox2[offsets[owner]:offsets[owner] + size].view(b - a, lay.cols).bfloat16()
                    offsets[owner] += size
                self._apply(work[w], unit, o)

    def _apply(self, item, unit: int, o: Tensor) -> None:
        """W ← W(1 − ηλ) − η·0.2√max(r, c)·O on this rank's rows of `unit` (`o` holds exactly those rows)."""
        p, group, lay, _ = item
        lo = max(unit * lay.unit_rows, lay.lo) - lay.lo
        rows = _local(p).view(-1, lay.cols)[lo:lo + o.shape[0]]
        lr = group["lr"]
        rows.mul_(1 - lr * group["weight_decay"])
        rows.add_(o, alpha=-lr * update_scale(lay.unit_rows, lay.cols))


DEFAULT_ADAMW_PATTERNS = (r"embed", r"lm_head", r"norm", r"\.bias$")
HEAD_PATTERNS = {r"self_attn\.q_proj\.weight$": "num_attention_heads",
                 r"self_attn\.(k|v)_proj\.weight$": "num_key_value_heads"}


def muon_param_groups(model: torch.nn.Module, adamw_patterns: tuple[str, ...] = DEFAULT_ADAMW_PATTERNS,
                      per_head: bool = True) -> tuple[list[dict], list[dict]]:
    """(Muon groups, AdamW groups) for a model: a parameter whose name matches an AdamW pattern, or that is not a
    2-D/3-D matrix, goes to AdamW; the rest to Muon, q/k/v per head (rows per head from the model config).
    Every parameter lands in exactly one group; a parameter matched by two rules is an error."""
    config = model.config
    muon: dict[int | None, list] = {}
    adamw: list = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        to_adamw = any(re.search(pat, name) for pat in adamw_patterns) or p.ndim not in (2, 3)
        heads = [attr for pat, attr in HEAD_PATTERNS.items() if re.search(pat, name)]
        if to_adamw and heads and per_head:
            raise ValueError(f"{name} matches both an AdamW pattern and a per-head Muon rule; fix adamw_patterns")
        if to_adamw:
            adamw.append(p)
            continue
        rows = p.shape[0] // getattr(config, heads[0]) if heads and per_head else None
        muon.setdefault(rows, []).append(p)
    if not muon:
        raise ValueError("no parameter left for Muon: every parameter matched an AdamW pattern")
    return ([{"params": ps, "unit_rows": rows} for rows, ps in muon.items()],
            [{"params": adamw}] if adamw else [])
