"""Targeted self-distillation: the hinted policy teaches the unhinted one, on the turn the hint is about.

Cursor's targeted RL with textual feedback, after SDPO (arXiv 2601.20802), OPSD (arXiv 2601.18734) and SDFT
(arXiv 2601.19897): when an episode goes wrong at a turn, a hint is written for that turn. The *teacher* is the
model with the hint inserted into its context immediately before the target message; the *student* is the policy
in the context it actually had. On the target message's tokens y_1..y_n (sampled by the student's policy, so
on-policy) we minimise a divergence between the two next-token distributions p_s (student) and p_t (teacher):

    reverse KL   KL(p_s ‖ p_t) = Σ_v p_s(v) log(p_s(v) / p_t(v))     mode-seeking; the on-policy distillation default
    forward KL   KL(p_t ‖ p_s) = Σ_v p_t(v) log(p_t(v) / p_s(v))     mass-covering
    JSD(α)       α KL(p_t ‖ m) + (1 − α) KL(p_s ‖ m),  m = α p_t + (1 − α) p_s   (generalised JSD of GKD,
                 arXiv 2306.13649; α → 0 behaves like forward KL, α → 1 like reverse KL, both scaled)

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
the sampler that drew y (the student may have moved since), and clipped at `token_kl_clip` so that a few tokens
where the teacher is sure and the student is not cannot dominate. The distillation loss is the mean over target
tokens and joins the policy loss with weight λ: L = L^PG + λ L^distill.

**Lift.** A hint is kept only when it argues against what the student did. Its lift is the mean, over the turn's
sampled tokens y_1..y_n, of log p_s(y_i) − log p_t(y_i): how much less likely the hinted teacher finds the sampled
turn than the student does. A hint with lift ≤ `min_lift` (default 0: the teacher would make the sampled behaviour
*more* likely, or changes nothing) is dropped from the loss — its tokens stay in the denominator, so the other hints'
weight does not grow — and counted; the trainer reports lift per hint kind (`hint_lift_<kind>`).

Note on `torch.nn.functional.kl_div(input, target)`: it computes Σ target (log target − input), i.e.
KL(target ‖ exp(input)) — the *second* argument is the first distribution of the KL. We write the sums out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from shipyard.train.losses import token_logprobs

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
        if self.top_k < 1 or self.is_clip < 1 or self.token_kl_clip <= 0 or not 0 <= self.ema_decay < 1:
            raise ValueError("top_k >= 1, is_clip >= 1, token_kl_clip > 0 and 0 <= ema_decay < 1 are required")


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
    """Per-token log p_s(y) − log p_t(y) of the sampled tokens [N] (no gradient): > 0 where the hinted teacher finds
    the student's choice less likely."""
    with torch.no_grad():
        s = token_logprobs(student_logits.detach()[None], tokens[None])[0][0]
        t = token_logprobs(teacher_logits.detach()[None], tokens[None])[0][0]
    return s - t


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
        d = divergence(log_s, log_t, config.divergence, config.jsd_alpha).clamp(max=config.token_kl_clip)
        per_token = w * d
        value = d.detach()
    loss = per_token.mean() if per_token.numel() else student_logits.sum() * 0
    with torch.no_grad():
        metrics = {"distill_divergence": float(value.mean()) if value.numel() else 0.0,
                   "distill_tokens": float(tokens.numel()),
                   "distill_teacher_logprob_gain": float((lp_t - lp_s).mean()) if tokens.numel() else 0.0,
                   "distill_is_weight_mean": float(w.mean()) if w.numel() else 0.0}
    return loss, metrics
