"""Targeted self-distillation: the hinted policy teaches the unhinted one, on the turn the hint is about.

This module holds the teacher's side: its row (the student's with the hint's ids inserted before the turn's
assistant header, `teacher_row`), its logits at the target tokens (`teacher_logits_at_hints`), the loss and its lift
test (`distill_term`, per micro-batch). The trainer owns the teacher module (an EMA copy, the frozen initial weights or
the live policy) and calls the two. The hints themselves (`shipyard.rollout.record.Hint`) are written by the RL loop's
detectors (`shipyard.rl.hints`) and placed in token coordinates by the batch (`shipyard.train.batch.place_hint` →
`HintTarget`).

Cursor's targeted RL with textual feedback, after SDPO (arXiv 2601.20802), OPSD (arXiv 2601.18734) and SDFT
(arXiv 2601.19897): when an episode goes wrong at a turn, a hint is written for that turn. The *teacher* is the
model with the hint inserted into its context immediately before the target message; the *student* is the policy
in the context it actually had. On the target message's tokens y_1..y_n (sampled by the student's policy, so
on-policy) we minimise a divergence between the two next-token distributions p_s (student) and p_t (teacher):

    reverse KL   KL(p_s ‖ p_t) = Σ_v p_s(v) log(p_s(v) / p_t(v))     mode-seeking; the on-policy distillation default
    forward KL   KL(p_t ‖ p_s) = Σ_v p_t(v) log(p_t(v) / p_s(v))     mass-covering
    JSD(α)       α KL(p_t ‖ m) + (1 − α) KL(p_s ‖ m),  m = α p_t + (1 − α) p_s   (generalised JSD of GKD,
                 arXiv 2306.13649; in value α → 0 behaves like forward KL, α → 1 like reverse KL, both scaled)

over one of three supports:

    full      the whole vocabulary;
    topk      the teacher's K most likely tokens plus one tail bucket holding the rest of each distribution's
              mass (1 − Σ_K p), so both are proper distributions over K + 1 outcomes;
    sampled   only the sampled token y (reverse KL only): with y ~ p_s, log p_s(y) − log p_t(y) is an unbiased
              estimate of KL(p_s ‖ p_t), and its gradient is the policy gradient with reward −(log p_s − log p_t):
              loss = sg(log p_s(y) − log p_t(y)) · log p_s(y).

Distillation is on only when hints can arrive (`enabled`, set by the RL loop when its hints are on): only then
is a teacher built. The teacher runs without gradient (frozen initial weights, an EMA of the policy — the default —
or the live policy). Every per-token term is multiplied by a truncated importance weight min(p_s(y)/μ(y), 2), μ
the sampler that drew y (the student may have moved since), and bounded by `token_kl_clip` c so that a few tokens
where the teacher is sure and the student is not cannot dominate: such a term counts c · d / sg(d) — c in value,
its gradient scaled by c/d rather than cut to zero as a clamp would (those tokens are what a hint is for). The
distillation loss is the mean over target tokens and joins the policy loss with weight λ: L = L^PG + λ L^distill.

Which divergence can teach what: the reverse KL's gradient at a token v is p_s(v)·[log(p_s(v)/p_t(v)) − KL], so it
moves no mass onto a token the student almost never writes (the bundled 0.5B gives `<tool_call>` p ≈ 1e-10 as a
turn's first token) however sure the teacher is; the forward KL's, p_s(v) − p_t(v), pulls it up by the teacher's
mass. The JSD's gradient at v is p_s(v)·[(1 − α)·log(p_s(v)/m(v)) − E_s(…)], scaled by p_s(v) like the reverse
KL's for every α (α → 0 makes its *value* forward-KL-like, not its gradient). A hint that teaches a new form (an
exact call in its tags) needs `forward_kl`, with `full` or `topk` support.

**Lift.** A hint is kept only when it argues against what the student actually did. With y_i the turn's sampled
tokens and p_s, p_t the distributions at position i, its lift is the mean over the turn of

    ℓ_i = [log p_s(y_i) − log p_t(y_i)] − KL(p_s ‖ p_t)

how much less likely the hinted teacher finds the student's actual choice than it finds a typical choice of the
student. The log-ratio alone is no test: for tokens drawn from p_s its expectation *is* KL(p_s ‖ p_t) ≥ 0, so any
hint that changes the teacher at all — relevant or not, or an EMA teacher that merely lags the policy — would pass on
average. Centred by the KL, ℓ has expectation 0 for a hint unrelated to what was sampled, and is positive when the
hint disfavours the very tokens the student chose (the detector hinted that turn because of them). A hint with lift
≤ `min_lift` (default 0) is dropped from the loss — its tokens stay in the denominator, so the other hints' weight
does not grow — and counted; the trainer reports the mean lift per hint kind (`hint_lift_<kind>`). With an `ema` or
`frozen` teacher the lift also carries the teacher's distance from the policy; the `live` teacher measures the hint
alone.

Note on `torch.nn.functional.kl_div(input, target)`: it computes Σ target (log target − input), i.e.
KL(target ‖ exp(input)) — the *second* argument is the first distribution of the KL. We write the sums out.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from shipyard.train.batch import Batch, HintTarget
from shipyard.train.prefix import forward_layout, layout

LIFT_CHUNK = 128  # positions per chunk of the lift's log-distributions
Divergence = Literal["reverse_kl", "forward_kl", "jsd"]
Support = Literal["full", "topk", "sampled"]
TeacherKind = Literal["ema", "frozen", "live"]


@dataclass
class DistillConfig:
    # Whether hints can arrive (the RL loop's hints are on). Off: no teacher is built — no copy of the model — and a
    # batch carrying hints is refused. On with teacher "ema": an EMA copy of the policy (one more model in memory).
    enabled: bool = False
    weight: float = 1.0  # λ
    divergence: Divergence = "reverse_kl"
    jsd_alpha: float = 0.5
    support: Support = "full"
    top_k: int = 32
    is_clip: float = 2.0
    token_kl_clip: float = 10.0
    teacher: TeacherKind = "ema"
    ema_decay: float = 0.99
    min_lift: float = 0.0  # hints whose lift (module docstring) is not above this are dropped; -1e9 keeps every one

    def __post_init__(self) -> None:
        if self.divergence not in ("reverse_kl", "forward_kl", "jsd"):
            raise ValueError(f"unknown divergence {self.divergence!r}: reverse_kl, forward_kl or jsd")
        if self.support not in ("full", "topk", "sampled"):
            raise ValueError(f"unknown support {self.support!r}: full, topk or sampled")
        if self.support == "sampled" and self.divergence != "reverse_kl":
            raise ValueError("the sampled-token support estimates only the reverse KL (the tokens come from the "
                             "student); use support 'full' or 'topk' for forward KL and JSD")
        if self.teacher not in ("ema", "frozen", "live"):
            raise ValueError(f"unknown teacher {self.teacher!r}: ema, frozen or live")
        if not 0 < self.jsd_alpha < 1:
            raise ValueError(f"jsd_alpha must be in (0, 1), got {self.jsd_alpha}")
        if not (math.isfinite(self.weight) and self.weight >= 0 and math.isfinite(self.min_lift)):
            raise ValueError(f"distill.weight must be finite and >= 0 and distill.min_lift finite, got "
                             f"{self.weight} and {self.min_lift}")
        if self.top_k < 1 or self.is_clip < 1 or self.token_kl_clip <= 0 or not 0 <= self.ema_decay < 1:
            raise ValueError("top_k >= 1, is_clip >= 1, token_kl_clip > 0 and 0 <= ema_decay < 1 are required")


def teacher_row(ids: torch.Tensor, target: HintTarget) -> tuple[torch.Tensor, int]:
    """The teacher's context: the student's ids with the hint inserted; and the shift of later positions."""
    hint = torch.tensor(target.hint_ids, dtype=ids.dtype, device=ids.device)
    return torch.cat([ids[:target.insert_at], hint, ids[target.insert_at:]]), len(target.hint_ids)


def kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) = Σ p (log p − log q) over the last dim, from log-probabilities (0 · log 0 = 0)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def divergence(log_s: torch.Tensor, log_t: torch.Tensor, kind: Divergence, alpha: float = 0.5) -> torch.Tensor:
    """Per-position divergence between student and teacher log-distributions [..., V] (see the docstring)."""
    if kind == "reverse_kl":
        return kl(log_s, log_t)
    if kind == "forward_kl":
        return kl(log_t, log_s)
    log_m = torch.logsumexp(torch.stack([log_t + torch.log(torch.tensor(alpha)),
                                         log_s + torch.log(torch.tensor(1 - alpha))]), 0)
    return alpha * kl(log_t, log_m) + (1 - alpha) * kl(log_s, log_m)


def topk_with_tail(log_p: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Log-distribution over the K tokens of `index` plus one tail bucket with the remaining mass: [..., K + 1]."""
    head = log_p.gather(-1, index)
    tail = torch.log1p(-head.exp().sum(-1, keepdim=True).clamp(max=1 - 1e-6))
    return torch.cat([head, tail], -1)


def lift(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per sampled token [N], no gradient: log p_s(y) − log p_t(y) − KL(p_s ‖ p_t) (the module docstring's ℓ), in
    chunks of positions so that the float32 log-distributions of a long hinted turn never exist whole."""
    out = []
    with torch.no_grad():
        for s in range(0, tokens.shape[0], LIFT_CHUNK):
            log_s = student_logits[s:s + LIFT_CHUNK].detach().float().log_softmax(-1)
            log_t = teacher_logits[s:s + LIFT_CHUNK].detach().float().log_softmax(-1)
            ratio = (log_s - log_t).gather(-1, tokens[s:s + LIFT_CHUNK, None]).squeeze(-1)
            out.append(ratio - kl(log_s, log_t))
    return torch.cat(out) if out else tokens.new_zeros(0, dtype=torch.float32)


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tokens: torch.Tensor,
                 sampler_logprobs: torch.Tensor, config: DistillConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean divergence over N target positions: logits [N, V] (teacher's detached here), sampled `tokens` [N],
    the sampler's logprobs of them [N]. Returns the loss (gradient through the student only) and metrics."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must cover the same target positions")
    log_s = student_logits.float().log_softmax(-1)
    log_t = teacher_logits.detach().float().log_softmax(-1)
    lp_s = log_s.gather(-1, tokens[:, None]).squeeze(-1)
    lp_t = log_t.gather(-1, tokens[:, None]).squeeze(-1)
    w = (lp_s.detach() - sampler_logprobs.detach()).exp().clamp(max=config.is_clip)
    if config.support == "sampled":
        gap = (lp_s.detach() - lp_t).clamp(-config.token_kl_clip, config.token_kl_clip)
        per_token = w * gap * lp_s
        value = gap
    else:
        if config.support == "topk":
            index = log_t.topk(min(config.top_k, log_t.shape[-1]), -1).indices
            log_s, log_t = topk_with_tail(log_s, index), topk_with_tail(log_t, index)
        d = divergence(log_s, log_t, config.divergence, config.jsd_alpha)
        # Bounded, not cut: min(d, c) in value, the gradient scaled by c/d. A clamp's gradient is 0 above c, which
        # dropped exactly the tokens where the teacher is sure and the student is not (the ones a hint is for).
        scaled = d * (config.token_kl_clip / d.detach().clamp(min=1e-12)).clamp(max=1.0)
        d = torch.where(torch.isfinite(d), scaled, d.clamp(max=config.token_kl_clip))  # inf · 0 would be nan
        per_token = w * d
        value = d.detach()
    loss = per_token.mean() if per_token.numel() else student_logits.sum() * 0
    with torch.no_grad():
        metrics = {"distill_divergence": float(value.mean()) if value.numel() else 0.0,
                   "distill_tokens": float(tokens.numel()),
                   "distill_teacher_logprob_gain": float((lp_t - lp_s).mean()) if tokens.numel() else 0.0,
                   "distill_is_weight_mean": float(w.mean()) if w.numel() else 0.0}
    return loss, metrics


def teacher_logits_at_hints(teacher: nn.Module, mb: Batch, pad_id: int, shared_prefix: int,
                            autocast: contextlib.AbstractContextManager) -> torch.Tensor:
    """The teacher's logits at the target positions of the micro-batch's hints (each row with its hint inserted),
    concatenated in hint order. A rank with no hint runs a two-token stand-in, so that its FSDP collectives stay in
    step with the ranks that have some."""
    device = mb.input_ids.device
    targets = [h for h in mb.hints if mb.sample_mask[h.sample] > 0]
    rows, spans = [], []
    for h in targets:
        length = int(mb.attention_mask[h.sample].sum())
        row, shift = teacher_row(mb.input_ids[h.sample, :length], h)
        rows.append(row)
        spans.append((h.start - 1 + shift, h.end - 1 + shift))
    if not rows:
        rows = [torch.tensor([pad_id] * 2, device=device)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    att = torch.zeros_like(ids)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)], att[i, :len(r)] = r, 1
    for i, (a, b) in enumerate(spans):
        keep[i, a:b] = True
    with torch.no_grad(), autocast:  # logits of the target spans only, flattened in hint order
        return forward_layout(teacher, layout(ids, att, pad_id, shared_prefix), keep)


def distill_term(mb: Batch, logits: torch.Tensor, keep: torch.Tensor, teacher_logits: torch.Tensor, denominator: float,
                 config: DistillConfig, add: Callable[[str, float], None]) -> torch.Tensor | float:
    """λ × this micro-batch's share of the step's distillation loss (`denominator`: the step's hinted tokens, all
    ranks): `logits` are the student's at `keep`'s positions (flattened, row-major), `teacher_logits` from
    `teacher_logits_at_hints`. Hints without lift are dropped (module docstring). Metrics go to `add` — "d:" keys
    weighted by tokens, "s:" keys summed, "distill_tokens"."""
    hinted = [h for h in mb.hints if mb.sample_mask[h.sample] > 0]
    if not hinted:
        return 0.0
    row_of = torch.full(keep.shape, -1, dtype=torch.long, device=keep.device)
    row_of[keep] = torch.arange(int(keep.sum()), device=keep.device)
    student = torch.cat([logits[row_of[h.sample, h.start - 1:h.end - 1]] for h in hinted])
    tokens = torch.cat([mb.input_ids[h.sample, h.start:h.end] for h in hinted])
    sampler = torch.cat([mb.sampler_logprobs[h.sample, h.start:h.end] for h in hinted])
    # each hint's lift (module docstring): one without lift is dropped from the loss, not from the denominator
    spans = [h.end - h.start for h in hinted]
    per_hint = torch.stack([x.mean() for x in lift(student, teacher_logits, tokens).split(spans)])
    kept = per_hint > config.min_lift
    for h, value, ok in zip(hinted, per_hint.tolist(), kept.tolist(), strict=True):
        for suffix in ("", *(f"_{kind}" for kind in h.kinds)):
            add("s:hints" + suffix, 1.0)
            add("s:hint_lift_sum" + suffix, value)
        add("s:hints_kept", float(ok))
    if not bool(kept.all()):
        rows = torch.repeat_interleave(kept, torch.tensor(spans, device=kept.device))
        student, teacher_logits, tokens, sampler = (x[rows] for x in (student, teacher_logits, tokens,
                                                                      sampler))
    if not tokens.numel():
        return 0.0
    dl, dm = distill_loss(student, teacher_logits, tokens, sampler, config)
    k = float(tokens.numel())
    for key, v in dm.items():
        if key != "distill_tokens":
            add("d:" + key, v * k)
    add("distill_tokens", k)
    add("s:distill_loss", float(dl.detach()) * k / denominator)
    return config.weight * dl * k / denominator
