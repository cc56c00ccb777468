"""The policy loss against hand-written per-token formulas, term by term."""

import math

import pytest
import torch

from shipyard.train.losses import PolicyLossConfig, aggregate, k3, policy_loss, token_logprobs


def _inputs(seed=0, b=3, t=7):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3
    old = lp + (torch.rand(b, t, generator=g) - 0.5) * 0.8  # ratios in roughly [0.67, 1.5]
    sampler = old + (torch.rand(b, t, generator=g) - 0.5) * 2.0
    adv = torch.tensor([[1.5], [-0.7], [0.3]])[:b].expand(b, t).clone()
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    return lp, old, sampler, adv, mask


def _manual_per_token(lp, old, sampler, adv, cfg, ref=None):
    out = [[0.0] * lp.shape[1] for _ in range(lp.shape[0])]
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            r = math.exp(lp[i, t] - old[i, t])
            a = float(adv[i, t])
            pg = -min(r * a, min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high) * a)
            w = min(math.exp(old[i, t] - sampler[i, t]), cfg.is_cap)
            term = w * pg
            if ref is not None:
                x = float(ref[i, t] - lp[i, t])
                term += cfg.kl_coef * (math.exp(x) - x - 1)
            out[i][t] = term
    return out


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_policy_loss_matches_the_formula(mode):
    lp, old, sampler, adv, mask = _inputs()
    ref = lp - 0.3
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, is_cap=2.0, aggregation=mode, kl_coef=0.05)
    loss, _ = policy_loss(lp, old, sampler, adv, mask, cfg, ref_logprobs=ref)
    per = _manual_per_token(lp, old, sampler, adv, cfg, ref)
    m = mask.tolist()
    if mode == "token_mean":
        want = sum(per[i][t] * m[i][t] for i in range(3) for t in range(7)) / sum(map(sum, m))
    elif mode == "seq_mean_token_mean":
        want = sum(sum(per[i][t] * m[i][t] for t in range(7)) / sum(m[i]) for i in range(3)) / 3
    else:
        want = sum(sum(per[i][t] * m[i][t] for t in range(7)) / 7 for i in range(3)) / 3
    assert float(loss) == pytest.approx(want, rel=1e-5)


def test_clipping_removes_the_gradient_and_is_counted():
    lp = torch.tensor([[0.5, -0.5, 0.5, -0.5]], requires_grad=True)  # ratios e^0.5=1.65 and e^-0.5=0.61 vs old 0
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    cfg = PolicyLossConfig(clip_low=0.2, clip_high=0.28, is_cap=2.0)
    loss, metrics = policy_loss(lp, old, old, adv, torch.ones(1, 4), cfg)
    loss.backward()
    # A > 0 and r above 1 + ε_high: clipped (no gradient); A > 0, r low: gradient; A < 0, r high: gradient;
    # A < 0 and r below 1 − ε_low: clipped.
    assert lp.grad[0, 0] == 0 and lp.grad[0, 3] == 0
    assert lp.grad[0, 1] != 0 and lp.grad[0, 2] != 0
    assert metrics["clip_fraction"] == pytest.approx(0.5)


def test_importance_weight_is_truncated_and_carries_no_gradient():
    lp = torch.zeros(1, 3, requires_grad=True)
    sampler = torch.tensor([[0.0, -math.log(1.5), -3.0]])  # weights 1, 1.5, e^3 → capped at 2
    loss, metrics = policy_loss(lp, lp.detach(), sampler, torch.ones(1, 3), torch.ones(1, 3),
                                PolicyLossConfig(is_cap=2.0))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(1 + 1.5 + 2) / 3, rel=1e-6)
    assert lp.grad.tolist()[0] == pytest.approx([-1 / 3, -1.5 / 3, -2 / 3], rel=1e-5)  # d(r·A)/dlp = w·r·A
    assert metrics["is_capped_fraction"] == pytest.approx(1 / 3)


def test_k3_is_a_nonnegative_kl_estimate():
    lp = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    ref = torch.log(torch.tensor([0.3, 0.3, 0.4]))
    p, q = lp.exp(), ref.exp()
    exact = float((p * (lp - ref)).sum())  # KL(π ‖ π_ref)
    assert (k3(lp, ref) >= 0).all()
    assert float((p * k3(lp, ref)).sum()) == pytest.approx(exact, rel=1e-5)  # unbiased under samples from π
    assert float(k3(lp, lp).abs().max()) == 0
    assert q.sum() == pytest.approx(1)


def test_failed_samples_and_padding_contribute_nothing():
    lp, old, sampler, adv, mask = _inputs(seed=1)
    sample_mask = torch.tensor([1.0, 0.0, 1.0])
    full = mask * sample_mask[:, None]
    loss, _ = policy_loss(lp, old, sampler, adv, full, PolicyLossConfig())
    lp2 = lp.clone()
    lp2[1] = 123.0  # garbage in the failed sample
    adv2 = adv.clone()
    adv2[1] = 99.0
    loss2, _ = policy_loss(lp2, old, sampler, adv2, full, PolicyLossConfig())
    assert float(loss) == float(loss2)


def test_micro_batches_with_a_shared_denominator_sum_to_the_full_loss():
    lp, old, sampler, adv, mask = _inputs(seed=2)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        cfg = PolicyLossConfig(aggregation=mode)
        full, _ = policy_loss(lp, old, sampler, adv, mask, cfg)
        den = float(mask.sum()) if mode == "token_mean" else float((mask.sum(-1) > 0).sum())
        parts = sum(float(policy_loss(lp[i:i + 1], old[i:i + 1], sampler[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                                      cfg, denominator=den)[0]) for i in range(3))
        assert parts == pytest.approx(float(full), rel=1e-6), mode


@pytest.mark.parametrize("chunk", [1, 2, 3, None])
def test_token_logprobs_entropy_and_gradient_match_log_softmax(chunk):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    weights = torch.randn(2, 5, generator=g, dtype=torch.float64)
    lp, ent = token_logprobs(logits, targets, chunk=chunk)
    (grad,) = torch.autograd.grad((lp * weights).sum(), logits)
    ref = torch.log_softmax(logits, -1)
    ref_lp = ref.gather(-1, targets[..., None]).squeeze(-1)
    (ref_grad,) = torch.autograd.grad((ref_lp * weights).sum(), logits)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-6)
    assert torch.allclose(ent.double(), -(ref.exp() * ref).sum(-1), atol=1e-5)
    assert torch.allclose(grad, ref_grad, atol=1e-6)
    assert not ent.requires_grad


def test_token_logprobs_keeps_only_the_logits_for_the_backward():
    """Autograd through log_softmax would save a float32 [N, V] log-softmax besides the logits: 1.2 GB at 2,000
    positions of a 152k vocabulary. Saved for the backward: the logits once, then O(N)."""
    logits = torch.randn(64, 5000, requires_grad=True)
    targets = torch.randint(0, 5000, (64,))
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = token_logprobs(logits[None], targets[None], chunk=16)
    assert sum(saved) <= logits.numel() * 4 + 64 * 16
    lp.sum().backward()
    assert logits.grad.shape == logits.shape


def test_token_logprobs_of_bfloat16_logits_are_float32():
    logits = torch.randn(1, 3, 7).bfloat16().requires_grad_()
    lp, _ = token_logprobs(logits, torch.tensor([[1, 2, 3]]))
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="aggregation"):
        PolicyLossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="is_cap"):
        PolicyLossConfig(is_cap=0.5)
    with pytest.raises(ValueError, match="reference"):
        policy_loss(*[torch.zeros(1, 2)] * 5, PolicyLossConfig(kl_coef=0.1))
    assert float(aggregate(torch.ones(1, 3), torch.zeros(1, 3), "token_mean")) == 0
