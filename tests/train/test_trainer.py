"""The trainer on trajectories the harness produced (scripted replay engine and the tiny random model): the loss
it optimizes is the hand-computed one, failed samples count for nothing, hints distill, and 2 gloo ranks train
like 1."""

import copy
import itertools
import tempfile
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks

from shipyard.harness.tools import default_tools
from shipyard.harness.wire import ChatFormat
from shipyard.models.resolve import tiny_model
from shipyard.rollout.record import Hint
from shipyard.train.batch import Batch
from shipyard.train.distill import DistillConfig
from shipyard.train.losses import PolicyLossConfig, policy_loss, token_logprobs
from shipyard.train.trainer import OptimConfig, TrainConfig, Trainer, _idle_batch


def _trainer(**kw) -> Trainer:
    model, tok = tiny_model(seed=1)
    kw.setdefault("micro_batch", 2)
    config = TrainConfig(optim=OptimConfig(lr=1e-3, **kw.pop("optim", {})), **kw)
    return Trainer(model.float(), config, pad_id=tok.pad_token_id,
                   header_ids=ChatFormat(tok, default_tools()).assistant_header_ids())


ADV = [1.0, -0.5, 0.25, -1.0, 0.5, -0.25]


def test_step_optimizes_the_hand_computed_loss(episodes):
    trainer = _trainer()
    model = copy.deepcopy(tiny_model(seed=1)[0].float())
    batch = Batch.from_trajectories(episodes, ADV, pad_id=trainer.pad_id)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp, _ = token_logprobs(logits[:, :-1], batch.input_ids[:, 1:])
    mask = batch.loss_mask[:, 1:] * batch.sample_mask[:, None]
    want, _ = policy_loss(lp, lp.detach(), batch.sampler_logprobs[:, 1:], batch.advantages[:, 1:], mask,
                          PolicyLossConfig())
    before = {k: v.clone() for k, v in trainer.full_state_dict().items()}
    metrics = trainer.step(batch)
    assert metrics["policy_loss"] == pytest.approx(float(want.detach()), rel=1e-4, abs=1e-6)
    assert metrics["tokens"] == float(mask.sum()) and metrics["version"] == 1.0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    after = trainer.full_state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.embed_tokens.weight" in changed


def test_cross_entropy_is_the_nll_of_the_policy_tokens_only(episodes):
    """The SFT objective: −log π of the loss-masked tokens (the policy's turns), averaged over them; prompt and
    observation tokens are context only. Oracle: torch's cross-entropy, masked by hand."""
    trainer = _trainer(objective="cross_entropy")
    model = copy.deepcopy(tiny_model(seed=1)[0].float())
    batch = Batch.from_trajectories(episodes, [0.0] * len(episodes), pad_id=trainer.pad_id)  # advantages unread
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch.input_ids[:, 1:], reduction="none")
    mask = batch.loss_mask[:, 1:]
    assert 0 < mask.sum() < batch.attention_mask[:, 1:].sum()  # observations and prompts are in the rows
    want = float((nll * mask).sum() / mask.sum())
    metrics = trainer.step(batch)
    assert metrics["sft_loss"] == pytest.approx(want, rel=1e-4)
    assert metrics["nll"] == pytest.approx(want, rel=1e-4)
    assert "policy_loss" not in metrics and metrics["tokens"] == float(mask.sum())
    # A row whose policy tokens are all masked out contributes nothing: the same step without it.
    none = Batch.from_trajectories(episodes, [0.0] * len(episodes), pad_id=trainer.pad_id)
    none.loss_mask[0] = 0
    a, b = _trainer(objective="cross_entropy"), _trainer(objective="cross_entropy")
    ma, mb = a.step(none), b.step(none.rows(list(range(1, none.size))))
    assert ma["sft_loss"] == pytest.approx(mb["sft_loss"], rel=1e-6) and ma["tokens"] == mb["tokens"]
    with pytest.raises(ValueError, match="objective"):
        TrainConfig(objective="dpo")


def test_token_budget_micro_batches_give_the_same_step(episodes):
    lengths = sorted(len(t.token_ids()) for t in episodes)
    tokens = lengths[-1] + lengths[0] - 1  # the longest trajectory runs alone, the others share micro-batches
    rows, budget = _trainer(micro_batch=2), _trainer(micro_batch=8, micro_batch_tokens=tokens)
    mr, mt = rows.train_step(episodes, ADV), budget.train_step(episodes, ADV)
    # Same loss and gradient, summed over other groupings of the rows (so equal up to float summation order).
    for key in ("policy_loss", "grad_norm", "entropy"):
        assert mt[key] == pytest.approx(mr[key], rel=1e-5, abs=1e-7), key
    assert mt["tokens"] == mr["tokens"]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        TrainConfig(micro_batch_tokens=-1)


def test_activation_checkpointing_gives_the_same_step(episodes):
    """Recomputing activations in the backward pass (memory for compute) changes no number of the step."""
    plain, recompute = _trainer(), _trainer(activation_checkpointing=True)
    mp, mr = plain.train_step(episodes, ADV), recompute.train_step(episodes, ADV)
    for key in ("policy_loss", "grad_norm", "entropy"):
        assert mr[key] == pytest.approx(mp[key], rel=1e-6, abs=1e-8), key
    after_p, after_r = plain.full_state_dict(), recompute.full_state_dict()
    assert all(torch.allclose(after_p[k], after_r[k], rtol=1e-6, atol=1e-8) for k in after_p)
    with pytest.raises(ValueError, match="activation_checkpointing needs a transformers decoder"):
        Trainer(torch.nn.Linear(2, 2), TrainConfig(activation_checkpointing=True), pad_id=0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_an_episodes_last_observation_is_not_computed(episodes, aggregation):
    """A final tool output can run far past the episode's context budget (the budget is checked before a turn);
    nothing trained attends to it, so it is cut: the step is the loss of the whole rows (Dr. GRPO's L still the
    batch's padded length as given), none of it computed — and exactly the step of the rows without it."""
    long = copy.deepcopy(episodes)
    for traj in long:
        traj.turns[-1].observation_ids = traj.turns[-1].observation_ids + list(range(3, 203)) * 5
    policy = PolicyLossConfig(aggregation=aggregation)
    batch = Batch.from_trajectories(long, ADV, pad_id=0)
    model = copy.deepcopy(tiny_model(seed=1)[0].float())
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp, _ = token_logprobs(logits[:, :-1], batch.input_ids[:, 1:])
    want, _ = policy_loss(lp, lp.detach(), batch.sampler_logprobs[:, 1:], batch.advantages[:, 1:],
                          batch.loss_mask[:, 1:], policy)
    a, b = _trainer(policy=policy), _trainer(policy=policy)
    got = b.train_step(long, ADV)
    assert got["policy_loss"] == pytest.approx(float(want.detach()), rel=1e-4, abs=1e-6)
    assert got["forward_tokens"] < batch.attention_mask.sum() - 900 * len(long)
    if aggregation != "seq_mean_token_sum_norm":  # whose L is the padded length: longer here
        same = a.train_step(episodes, ADV)
        for key in ("policy_loss", "grad_norm", "entropy", "tokens", "forward_tokens"):
            assert same[key] == got[key], key
        for (k, x), y in zip(a.full_state_dict().items(), b.full_state_dict().values(), strict=True):
            assert torch.equal(x, y), k


def test_rows_with_nothing_trained_are_not_computed(episodes):
    """A rollout whose every token is stale (or that sampled nothing) has a reward but nothing to train: like a
    failed sample it is not computed, whatever its length."""
    a, b = _trainer(), _trainer()
    batch = Batch.from_trajectories(episodes[:3], ADV[:3], pad_id=a.pad_id)
    stale = copy.deepcopy(batch)
    stale.loss_mask[2] = 0
    failed = copy.deepcopy(batch)
    failed.sample_mask[2] = 0
    ms, mf = a.step(stale), b.step(failed)
    assert ms["forward_tokens"] == mf["forward_tokens"] and ms["policy_loss"] == mf["policy_loss"]
    first_only = copy.deepcopy(batch)
    first_only.loss_mask[:] = 0
    first_only.loss_mask[:, 0] = 1  # the first token is never predicted: nothing to train anywhere
    assert a.step(first_only)["skipped"] == 1.0


def test_idle_micro_batch_changes_nothing(episodes):
    trainer = _trainer()
    sums: dict[str, float] = {}
    trainer._micro(_idle_batch(trainer.pad_id, trainer.device), 1.0, 0.0, sums)
    grads = [p.grad for p in trainer.model.parameters()]
    assert all(g is None or not g.any() for g in grads) and sums["tokens"] == 0.0


def test_failed_samples_count_for_nothing(episodes):
    a, b = _trainer(), _trainer()
    batch = Batch.from_trajectories(episodes[:2], ADV[:2], pad_id=a.pad_id, failed=[False, True])
    garbage = copy.deepcopy(batch)
    g = torch.Generator().manual_seed(0)
    garbage.input_ids[1] = torch.randint(0, 200, garbage.input_ids[1].shape, generator=g)
    garbage.advantages[1] = 1e6
    garbage.sampler_logprobs[1] = -50.0
    ma, mb = a.step(batch), b.step(garbage)
    assert ma["policy_loss"] == mb["policy_loss"] and ma["tokens"] == mb["tokens"]
    before = {k: v.clone() for k, v in a.full_state_dict().items()}
    skipped = a.train_step(episodes[:2], ADV[:2], failed=[True, True])  # nothing known: no step at all
    assert skipped["skipped"] == 1.0 and a.version == 1
    assert all(torch.equal(v, a.full_state_dict()[k]) for k, v in before.items())
    for (k, x), y in zip(a.full_state_dict().items(), b.full_state_dict().values(), strict=True):
        assert torch.equal(x, y), k


def test_hints_distill_and_an_empty_hint_gives_zero_divergence(episodes):
    fmt = ChatFormat(tiny_model()[1], default_tools())
    multi = [i for i, t in enumerate(episodes) if len(t.turns) >= 2][:2]
    keep_all = DistillConfig(enabled=True, weight=0.5, teacher="live", min_lift=-1e9)
    hints = [Hint(0, 1, (), kinds=("call_format",))]  # nothing inserted: teacher context == student context
    metrics = _trainer(distill=keep_all).train_step([episodes[multi[0]]], [0.0], hints=hints)
    assert metrics["distill_tokens"] > 0 and metrics["distill_divergence"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["hint_lift"] == pytest.approx(0.0, abs=1e-6) and metrics["hints_call_format"] == 1
    # by default a hint without lift is dropped: the empty hint changes nothing, so it has none
    dropped = _trainer(distill=DistillConfig(enabled=True, teacher="live")).train_step([episodes[multi[0]]], [0.0],
                                                                                       hints=hints)
    assert dropped["hints"] == 1 and dropped["hints_kept"] == 0 and dropped["distill_tokens"] == 0
    ema = _trainer(distill=DistillConfig(enabled=True, weight=0.5, teacher="ema", ema_decay=0.5, min_lift=-1e9))
    hints = [Hint(0, 1, fmt.hint_ids("Read the test first.")), Hint(1, 0, fmt.hint_ids("List the files."))]
    m = ema.train_step([episodes[i] for i in multi], [0.0, 0.0], hints=hints)
    assert m["distill_divergence"] > 0 and m["distill_loss"] > 0 and m["hints_kept"] == 2


def test_the_distillation_term_moves_the_student_towards_the_hinted_teacher(episodes):
    """Zero advantages, one hinted turn, a frozen teacher (the initial weights) and a student moved away from it:
    the only gradient is the distillation's, and the divergence between the student and the hinted teacher on the
    turn's tokens falls step after step."""
    fmt = ChatFormat(tiny_model()[1], default_tools())
    index = next(i for i, t in enumerate(episodes) if len(t.turns) >= 2)
    hints = [Hint(0, 1, fmt.hint_ids("Reminder: write the call inside <tool_call></tool_call> tags."),
                  kinds=("call_format",))]
    trainer = _trainer(distill=DistillConfig(enabled=True, weight=1.0, teacher="frozen", min_lift=-1e9))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    divergences = [trainer.train_step([episodes[index]], [0.0], hints=hints)["distill_divergence"]
                   for _ in range(6)]
    assert divergences[-1] < 0.5 * divergences[0], divergences
    assert all(b < a for a, b in itertools.pairwise(divergences)), divergences


def _dist_worker(rank, world, episodes, out):
    trainer = _trainer()
    for _ in range(2):
        metrics = trainer.train_step(episodes[:4], ADV[:4])
    state = trainer.full_state_dict()
    assert trainer.engine_weights() is state and trainer.export_weights() is state  # one gather per version
    assert (state == {}) == (rank != 0)  # gathered to rank 0 alone
    bf16 = _trainer(compute_dtype="bfloat16").train_step(episodes[:4], ADV[:4])  # FSDP2 mixed precision
    # 3 rows over 2 ranks, one row per micro-batch: one rank runs an idle micro-batch to match the other's two.
    uneven = _trainer(micro_batch=1).train_step(episodes[:3], ADV[:3])
    if rank == 0:
        torch.save({"state": state, "metrics": metrics, "bf16": bf16, "uneven": uneven}, out)


def test_two_ranks_train_like_one(episodes):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "w2.pt"
        run_ranks(_dist_worker, 2, episodes[:4], str(out))
        two = torch.load(out)
    one = _trainer()
    init = {k: v.clone() for k, v in one.full_state_dict().items()}
    for _ in range(2):
        metrics = one.train_step(episodes[:4], ADV[:4])
    assert two["metrics"]["policy_loss"] == pytest.approx(metrics["policy_loss"], rel=1e-4, abs=1e-6)
    assert two["metrics"]["tokens"] == metrics["tokens"]
    assert two["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    # bfloat16: FSDP2's mixed-precision policy with 2 ranks, autocast with one; same loss to bf16 accuracy.
    one_bf16 = _trainer(compute_dtype="bfloat16").train_step(episodes[:4], ADV[:4])
    assert two["bf16"]["policy_loss"] == pytest.approx(one_bf16["policy_loss"], rel=0.05, abs=1e-4)
    assert two["bf16"]["tokens"] == one_bf16["tokens"]
    assert two["bf16"]["grad_norm"] == pytest.approx(one_bf16["grad_norm"], rel=0.1)
    one_uneven = _trainer(micro_batch=1).train_step(episodes[:3], ADV[:3])
    for key in ("policy_loss", "grad_norm", "tokens"):
        assert two["uneven"][key] == pytest.approx(one_uneven[key], rel=1e-4, abs=1e-6), key
    # Gradients are reduced in another order across ranks and each rank packs its own rows (other matmul shapes),
    # so they differ in the last float bits; Newton–Schulz runs in bfloat16 on normalized gradients, where a head
    # with a near-zero gradient amplifies such rounding: after two steps the updates agree to within 10 % in
    # Frobenius norm, not bitwise (Muon itself is bitwise across ranks for equal gradients: test_muon.py).
    for k, v in one.full_state_dict().items():
        update, other = v - init[k], two["state"][k] - init[k]
        assert float((update - other).norm()) <= 0.1 * float(update.norm()) + 1e-9, k


def test_moe_model_trains_with_experts_as_muon_units(episodes):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = tiny_model()[1]
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, pad_token_id=tok.pad_token_id,
                            eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    train = TrainConfig(optim=OptimConfig(name="muon", lr=1e-3), micro_batch=2)
    trainer = Trainer(Qwen3MoeForCausalLM(config), train, pad_id=tok.pad_token_id)
    muon = trainer.optimizers[0]
    experts = [p for g in muon.param_groups for p in g["params"] if p.ndim == 3]
    assert len(experts) == 4  # gate_up_proj and down_proj of 2 layers, one unit per expert
    before = trainer.full_state_dict()["model.layers.0.mlp.experts.down_proj"].clone()
    metrics = trainer.train_step(episodes[:2], ADV[:2])
    assert torch.isfinite(torch.tensor(metrics["policy_loss"]))  # a random MoE's loss: no value to expect
    assert not torch.equal(before, trainer.full_state_dict()["model.layers.0.mlp.experts.down_proj"])


def test_bfloat16_compute_keeps_float32_master_weights(episodes):
    fp32, bf16 = _trainer(), _trainer(compute_dtype="bfloat16")
    m32, m16 = fp32.train_step(episodes[:2], ADV[:2]), bf16.train_step(episodes[:2], ADV[:2])
    assert all(v.dtype == torch.float32 for v in bf16.full_state_dict().values())
    assert m16["policy_loss"] == pytest.approx(m32["policy_loss"], rel=0.05, abs=1e-4)
    assert m16["tokens"] == m32["tokens"]
