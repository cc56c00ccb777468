"""Targeted self-distillation: divergence directions against Σ p log(p/q), supports, gradients, masks."""

import math

import pytest
import torch
import torch.nn.functional as F

from shipyard.train.distill import DistillConfig, distill_loss, divergence, kl, lift, topk_with_tail


def _dists(seed=0, n=4, v=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 2, torch.randn(n, v, generator=g) * 2


def _manual_kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def test_kl_directions_against_the_sum():
    s_logits, t_logits = _dists()
    log_s, log_t = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
    for row in range(4):
        p_s, p_t = log_s[row].exp().tolist(), log_t[row].exp().tolist()
        rev = float(divergence(log_s[row], log_t[row], "reverse_kl"))
        fwd = float(divergence(log_s[row], log_t[row], "forward_kl"))
        assert rev == pytest.approx(_manual_kl(p_s, p_t), rel=1e-5)  # KL(student ‖ teacher)
        assert fwd == pytest.approx(_manual_kl(p_t, p_s), rel=1e-5)  # KL(teacher ‖ student)
        assert rev != pytest.approx(fwd, rel=1e-3)
    # F.kl_div(input, target) is KL(target ‖ input): the reverse KL needs the *student* as target.
    torch_rev = F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1)
    assert torch.allclose(torch_rev, kl(log_s, log_t), atol=1e-6)


def test_jsd_against_the_definition():
    s_logits, t_logits = _dists(1)
    log_s, log_t = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
    for alpha in (0.1, 0.5, 0.9):
        got = divergence(log_s, log_t, "jsd", alpha)
        for row in range(4):
            p_s, p_t = log_s[row].exp().tolist(), log_t[row].exp().tolist()
            m = [alpha * a + (1 - alpha) * b for a, b in zip(p_t, p_s, strict=True)]
            want = alpha * _manual_kl(p_t, m) + (1 - alpha) * _manual_kl(p_s, m)
            assert float(got[row]) == pytest.approx(want, rel=1e-4)
    assert (divergence(log_s, log_t, "jsd", 0.5) <= math.log(2) + 1e-6).all()


def test_topk_with_tail_is_a_distribution():
    s_logits, t_logits = _dists(2, v=50)
    log_t = t_logits.log_softmax(-1)
    index = log_t.topk(5, -1).indices
    for log_p in (log_t, s_logits.log_softmax(-1)):
        head_tail = topk_with_tail(log_p, index)
        assert head_tail.shape == (4, 6)
        assert torch.allclose(head_tail.exp().sum(-1), torch.ones(4), atol=1e-5)


@pytest.mark.parametrize("support,div", [("full", "reverse_kl"), ("full", "forward_kl"), ("full", "jsd"),
                                         ("topk", "reverse_kl"), ("topk", "jsd"), ("sampled", "reverse_kl")])
def test_no_gradient_through_the_teacher_and_zero_for_identical_contexts(support, div):
    s_logits, t_logits = _dists(3)
    tokens = torch.tensor([1, 4, 0, 8])
    cfg = DistillConfig(support=support, divergence=div, top_k=3)
    student = s_logits.clone().requires_grad_(True)
    teacher = t_logits.clone().requires_grad_(True)
    sampler = student.detach().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    loss, _ = distill_loss(student, teacher, tokens, sampler, cfg)
    loss.backward()
    assert teacher.grad is None
    assert student.grad is not None and student.grad.abs().sum() > 0
    same, metrics = distill_loss(s_logits, s_logits.clone(), tokens, sampler, cfg)
    assert float(same) == pytest.approx(0.0, abs=1e-6) and metrics["distill_divergence"] == pytest.approx(0, abs=1e-6)


def test_sampled_token_gradient_is_the_policy_gradient_of_the_reverse_kl():
    s_logits, t_logits = _dists(4, n=1, v=5)
    token = torch.tensor([2])
    student = s_logits.clone().requires_grad_(True)
    sampler = student.detach().log_softmax(-1)[:, 2]
    loss, _ = distill_loss(student, t_logits, token, sampler, DistillConfig(support="sampled"))
    loss.backward()
    log_s, log_t = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
    gap = float(log_s[0, 2] - log_t[0, 2])
    grad_logp = F.one_hot(token, 5).float() - log_s.exp()  # ∂ log p_s(y) / ∂ logits
    assert torch.allclose(student.grad, gap * grad_logp, atol=1e-6)


def test_importance_weight_and_token_clip():
    s_logits, t_logits = _dists(5, n=2)
    tokens = torch.tensor([0, 1])
    on_policy = s_logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    base, _ = distill_loss(s_logits, t_logits, tokens, on_policy, DistillConfig())
    stale, m = distill_loss(s_logits, t_logits, tokens, on_policy - 5.0, DistillConfig(is_clip=2.0))
    assert float(stale) == pytest.approx(2.0 * float(base), rel=1e-5) and m["distill_is_weight_mean"] == 2.0
    far = torch.zeros_like(t_logits)
    far[:, 3] = 50.0  # teacher certain of a token the student finds unlikely
    unlikely = s_logits.clone()
    unlikely[:, 3] = -20.0
    on_policy = unlikely.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    unlikely.requires_grad_(True)
    clipped, _ = distill_loss(unlikely, far, tokens, on_policy, DistillConfig(divergence="forward_kl",
                                                                              token_kl_clip=1.5))
    assert clipped.item() == pytest.approx(1.5, rel=1e-5)
    clipped.backward()  # bounded, not cut: the gradient still raises the teacher's token, scaled down
    assert (unlikely.grad[:, 3] < -0.01).all()  # a clamp gave exactly 0
    full = unlikely.detach().clone().requires_grad_(True)
    distill_loss(full, far, tokens, on_policy, DistillConfig(divergence="forward_kl", token_kl_clip=1e9))[0].backward()
    ratio = unlikely.grad / full.grad
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-4)  # the same direction per token


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="only the reverse KL"):
        DistillConfig(support="sampled", divergence="jsd")
    with pytest.raises(ValueError, match="divergence"):
        DistillConfig(divergence="kl")
    with pytest.raises(ValueError, match="same target positions"):
        distill_loss(torch.zeros(2, 3), torch.zeros(3, 3), torch.zeros(2, dtype=torch.long), torch.zeros(2),
                     DistillConfig())


def test_lift_is_the_sampled_log_ratio_centred_by_the_kl():
    """ℓ = log p_s(y) − log p_t(y) − KL(p_s ‖ p_t): zero for an identical teacher, zero on average over tokens drawn
    from the student (the plain log-ratio averages to the KL, > 0 for any teacher that differs), positive where the
    teacher disfavours the very token the student chose."""
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    y = torch.tensor([1, 4, 6])
    log_s, log_t = s.log_softmax(-1), t.log_softmax(-1)
    expected = (log_s - log_t).gather(-1, y[:, None]).squeeze(-1) - (log_s.exp() * (log_s - log_t)).sum(-1)
    assert torch.allclose(lift(s, t, y), expected, atol=1e-6)
    assert torch.allclose(lift(s, s, y), torch.zeros(3), atol=1e-6)
    drawn = torch.multinomial(log_s[0].exp(), 200_000, replacement=True, generator=g)
    mean = lift(s[:1].expand(len(drawn), -1), t[:1].expand(len(drawn), -1), drawn).mean()
    assert abs(float(mean)) < 0.02
    disliked = t.clone()
    disliked[0, 1] -= 5.0  # the teacher now strongly disfavours the student's first token
    assert lift(s, disliked, y)[0] > lift(s, t, y)[0] + 1


def test_an_infinite_divergence_is_bounded_not_nan():
    """A student logit of -inf under a token the teacher wants: the forward KL is inf; the term is the bound."""
    student = torch.tensor([[0.0, float("-inf"), 0.0]], requires_grad=True)
    teacher = torch.tensor([[0.0, 2.0, 0.0]])
    tokens = torch.tensor([0])
    loss, m = distill_loss(student, teacher, tokens, student.detach().log_softmax(-1)[:, 0],
                           DistillConfig(divergence="forward_kl", token_kl_clip=3.0))
    assert loss.item() == pytest.approx(3.0) and m["distill_divergence"] == pytest.approx(3.0)
