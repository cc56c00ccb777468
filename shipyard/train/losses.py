"""The policy-gradient loss: token-level clipped surrogate with importance correction against the sampler.

Notation, per sampled token t of sample i (mask m_it = loss mask × sample mask):

    log π_θ(y_t)   the trainer's current log-probability of the sampled token (with gradient)
    log π_old(y_t) the trainer's log-probability before this step's updates (= log π_θ, detached, when each
                   batch is used for a single optimizer step)
    log μ(y_t)     the sampler's log-probability (the inference engine: other kernels, maybe other precision,
                   maybe an older policy version)

    r_t   = exp(log π_θ − log π_old)                                      PPO ratio
    L^PG  = −min(r_t A_i, clip(r_t, 1 − ε_low, 1 + ε_high) A_i)            clipped surrogate (PPO, Schulman 2017);
                                                                          separate ε_high > ε_low is DAPO's
                                                                          "clip-higher" (arXiv 2503.14476)
    w_t   = min(exp(log π_old − log μ), C)    (no gradient)               truncated importance sampling between
                                                                          trainer and sampler (Yao et al. 2025,
                                                                          "Your efficient RL framework secretly
                                                                          brings you off-policy RL training")
    k3_t  = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1          Schulman's k3 estimator of
                                                                          KL(π_θ ‖ π_ref), optional (β)
    ℓ_t   = w_t L^PG_t + β k3_t

Aggregation over tokens:
    token_mean                Σ_it m ℓ / Σ_it m (every token weighs the same; DAPO's token-level loss)
    seq_mean_token_mean       mean_i (Σ_t m ℓ / Σ_t m) (the original GRPO: long answers weigh less per token)
    seq_mean_token_sum_norm   mean_i (Σ_t m ℓ) / L with a constant L (Dr. GRPO, arXiv 2503.20783: no length bias)

Samples whose reward is unknown (infrastructure failures) have sample mask 0 and contribute nothing.

Metrics (no gradient): clip fraction (tokens whose gradient the clip removed: r > 1 + ε_high with A > 0, or
r < 1 − ε_low with A < 0), fraction of IS weights at the cap, k3 estimates of KL(π_old ‖ π_θ) and of the
sampler/trainer mismatch KL(μ ‖ π_old).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


@dataclass
class PolicyLossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_cap: float = 2.0  # C: truncation of the trainer/sampler importance weight
    aggregation: Aggregation = "token_mean"
    norm_length: int | None = None  # L of seq_mean_token_sum_norm; None: the batch's padded length
    kl_coef: float = 0.0  # β: k3 KL to a reference policy (needs reference logprobs)

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.is_cap < 1:
            raise ValueError(f"is_cap must be >= 1 (1 disables up-weighting), got {self.is_cap}")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
            raise ValueError(f"unknown aggregation {self.aggregation!r}: token_mean, seq_mean_token_mean or "
                             "seq_mean_token_sum_norm")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


class _TargetLogprob(torch.autograd.Function):
    """log p(y) = z_y − logsumexp(z) over logits z [M, V], with the entropy H = logsumexp(z) − Σ_v p_v z_v alongside
    (no gradient). The backward, ∂ log p(y)/∂z = onehot(y) − softmax(z), is recomputed from the logits and the M
    saved logsumexps, chunk by chunk: autograd through `log_softmax` + `gather` would keep a float32 [M, V]
    log-softmax for the backward and build full-size gradients for it — at M = 2,000 sampled positions of a
    152k-token vocabulary (Qwen2.5), 1.2 GB each — where this keeps the logits themselves and their gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int):
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(lse)
        for s in range(0, logits.shape[0], chunk):
            z = logits[s:s + chunk].float()
            lse[s:s + chunk] = torch.logsumexp(z, -1)
            entropy[s:s + chunk] = lse[s:s + chunk] - (torch.softmax(z, -1) * z).sum(-1)
        logp = logits.gather(-1, targets[:, None]).squeeze(-1).float() - lse
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk):
            g = grad_logp[s:s + ctx.chunk, None].float()
            part = (logits[s:s + ctx.chunk].float() - lse[s:s + ctx.chunk, None]).exp_().mul_(-g)
            part.scatter_add_(-1, targets[s:s + ctx.chunk, None], g)
            grad[s:s + ctx.chunk] = part
        return grad, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """Log-probabilities of `targets` [B, T] under `logits` [B, T, V], and the entropy at each position (no
    gradient), in float32 whatever the logits' precision.

    Memory: the logits and, in the backward, their gradient — nothing else of vocabulary size outlives a chunk of
    `chunk` positions (default: ~32M logits a chunk). See `_TargetLogprob`.
    """
    batch, length, vocab = logits.shape
    if chunk is None:
        chunk = max(1, (1 << 25) // max(vocab, 1))
    logp, entropy = _TargetLogprob.apply(logits.reshape(-1, vocab), targets.reshape(-1), chunk)
    return logp.view(batch, length), entropy.view(batch, length)


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π ‖ π_ref) from samples of π: e^(ref − lp) − (ref − lp) − 1 ≥ 0."""
    log_ratio = ref_logprobs - logprobs
    return log_ratio.exp() - log_ratio - 1


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation, norm_length: int | None = None,
              denominator: float | None = None) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar over `mask` (see the module docstring).

    `denominator` overrides the count for token_mean / the sequence count for the sequence modes, so that
    micro-batches of one step can each be divided by the whole step's total (gradient accumulation then sums to
    exactly the full-batch loss).
    """
    if mode == "token_mean":
        return (per_token * mask).sum() / (denominator if denominator is not None else mask.sum().clamp(min=1))
    rows = mask.sum(-1) > 0
    n_rows = denominator if denominator is not None else rows.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        per_row = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_row.sum() / n_rows
    length = norm_length if norm_length is not None else per_token.shape[-1]
    return ((per_token * mask).sum(-1) / length).sum() / n_rows


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, config: PolicyLossConfig,
                ref_logprobs: torch.Tensor | None = None, denominator: float | None = None,
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss (scalar, with gradient through `logprobs`) and its metrics. All inputs are [B, T] aligned on the
    predicted tokens; `mask` already includes the sample mask."""
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs reference logprobs")
    old_logprobs, sampler_logprobs = old_logprobs.detach(), sampler_logprobs.detach()
    ratio = (logprobs - old_logprobs).exp()
    clipped_ratio = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    pg = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    raw_w = (old_logprobs - sampler_logprobs).exp()
    w = raw_w.clamp(max=config.is_cap)
    per_token = w * pg
    if config.kl_coef > 0:
        per_token = per_token + config.kl_coef * k3(logprobs, ref_logprobs.detach())
    loss = aggregate(per_token, mask, config.aggregation, config.norm_length, denominator)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clipped = ((ratio > 1 + config.clip_high) & (advantages > 0)) | ((ratio < 1 - config.clip_low)
                                                                       & (advantages < 0))
        metrics = {
            "clip_fraction": float((clipped.float() * mask).sum() / n),
            "is_capped_fraction": float(((raw_w > config.is_cap).float() * mask).sum() / n),
            "is_weight_mean": float((w * mask).sum() / n),
            # Tokens were drawn from μ ≈ π_old: k3(samples' policy, other policy) estimates KL(samples' ‖ other).
            "kl_old_new": float((k3(old_logprobs, logprobs.detach()) * mask).sum() / n),
            "kl_sampler_trainer": float((k3(sampler_logprobs, old_logprobs) * mask).sum() / n),
            "tokens": float(mask.sum()),
        }
        if ref_logprobs is not None:
            metrics["ref_kl"] = float((k3(logprobs.detach(), ref_logprobs) * mask).sum() / n)
    return loss, metrics
