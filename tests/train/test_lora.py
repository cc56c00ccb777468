"""LoRA in the trainer ([trainer.lora]): only the adapters train; a push carries only them and makes the engine
sample the trainer's policy; the export is the merged model, which plain transformers loads; checkpoints hold the
adapter (in peft's format) and resume bit-identically; 2 gloo ranks (FSDP2) train like 1."""

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from gloo_ranks import run_ranks
from safetensors.torch import load_file

from shipyard.errors import UsageError
from shipyard.harness.tools import default_tools
from shipyard.harness.wire import ChatFormat
from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.local import LocalEngine
from shipyard.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraConfig, attach, is_adapter
from shipyard.models.payload import encode
from shipyard.models.resolve import TINY, make_engine, tiny_model
from shipyard.rl.loop import export_policy
from shipyard.train.batch import Batch
from shipyard.train.checkpoint import load_checkpoint, save_checkpoint
from shipyard.train.distill import DistillConfig
from shipyard.train.losses import PolicyLossConfig, token_logprobs
from shipyard.train.sync import sync
from shipyard.train.trainer import OptimConfig, TrainConfig, Trainer

PAD = tiny_model()[1].pad_token_id
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)


def _batch(seed: int = 0, rows: int = 4, prompt: int = 40) -> Batch:
    """A GRPO-like group: `rows` samples of one `prompt`-token prompt (computed once: the shared-prefix path), each
    with 12–40 sampled tokens, advantages ±1. Short rows keep the tests fast (the harness's trajectories are ~7k
    byte tokens each)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, 250, (prompt,), generator=g)
    lengths = torch.randint(12, 41, (rows,), generator=g).tolist()
    shape = (rows, prompt + max(lengths))
    ids, attention = torch.full(shape, PAD, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    loss, advantages = torch.zeros(shape), torch.zeros(shape)
    for i, n in enumerate(lengths):
        ids[i, :prompt + n] = torch.cat([head, torch.randint(0, 250, (n,), generator=g)])
        attention[i, :prompt + n], loss[i, prompt:prompt + n] = 1, 1.0
        advantages[i] = 1.0 if i % 2 else -1.0
    return Batch(input_ids=ids, attention_mask=attention, loss_mask=loss, sampler_logprobs=torch.full(shape, -5.5),
                 advantages=advantages, versions=torch.zeros(shape, dtype=torch.long), sample_mask=torch.ones(rows),
                 pad_id=PAD)


def _trainer(seed: int = 1, lr: float = 1e-2, **kw) -> Trainer:
    model, tok = tiny_model(seed=seed)
    kw.setdefault("micro_batch", 2)
    kw.setdefault("lora", LORA)
    config = TrainConfig(optim=OptimConfig(lr=lr, weight_decay=0.0), **kw)
    return Trainer(model.float(), config, pad_id=tok.pad_token_id,
                   header_ids=ChatFormat(tok, default_tools()).assistant_header_ids())


def _logprobs(model: torch.nn.Module, ids: list[int], start: int) -> torch.Tensor:
    """log π(ids[t] | ids[:t]) for t ≥ start, from one plain forward pass of `model` (float32)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits.float()
    return token_logprobs(logits[:, start - 1:-1], torch.tensor([ids[start:]]))[0][0]


def test_an_auto_compute_dtype_is_bfloat16_only_where_the_device_has_it():
    """compute_dtype = "auto" (configs/learning.toml): bf16 where the CPU multiplies bf16 in hardware, float32 on an
    AVX2-only CPU, where a bf16 LoRA step of the 0.5B took more than 14 minutes instead of ~4. The frozen base follows
    the resolved dtype; the adapters stay float32."""
    from shipyard.models.dtype import default_dtype, native_bfloat16

    native = native_bfloat16("cpu")
    trainer = _trainer(compute_dtype="auto")
    assert trainer.config.compute_dtype == ("bfloat16" if native else "float32")
    assert default_dtype("cpu") == (torch.bfloat16 if native else torch.float32)
    frozen = {p.dtype for p in trainer.model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16 if native else torch.float32}
    trainer.step(_batch())  # and it trains


def test_only_the_adapters_train_and_the_base_is_frozen_in_the_compute_dtype():
    trainer = _trainer(compute_dtype="bfloat16", distill=DistillConfig(enabled=True, teacher="ema", ema_decay=0.5))
    params = dict(trainer.model.named_parameters())
    trained = {n for n, p in params.items() if p.requires_grad}
    assert trained == {n for n in params if is_adapter(n)} and len(trained) == 2 * 7 * 2  # A, B × 7 linears × 2 layers
    assert all(p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16) for p in params.values())
    held = [p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]
    assert len(trainer.optimizers) == 1 and {id(p) for p in held} == {id(params[n]) for n in trained}
    # the EMA teacher shares the frozen base (no second copy) and has adapters of its own
    teacher = dict(trainer.ema.named_parameters())
    assert all(teacher[n] is p for n, p in params.items() if not p.requires_grad)
    assert all(teacher[n] is not params[n] for n in trained)

    before = {k: v.clone() for k, v in trainer.full_state_dict().items()}
    trainer.step(_batch())
    after = trainer.full_state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    # B = 0 at the start, so the first step's gradient reaches B only (∂L/∂A = Bᵀ…): exactly the B matrices moved
    assert changed == {n for n in trained if ".lora_B." in n}
    assert all(p.grad is None for p in params.values())  # zeroed to None after the step
    state = trainer.optimizers[0].state
    assert {id(p) for p in state} == {id(params[n]) for n in trained}  # optimizer state for the adapters only
    # the EMA moved the teacher's adapters halfway towards the policy's, and left the shared base alone
    b = "model.layers.0.mlp.up_proj.lora_B.default.weight"
    torch.testing.assert_close(teacher[b].detach(), 0.5 * after[b], rtol=0, atol=0)


def test_lora_with_activation_checkpointing_takes_the_same_step():
    """Recomputed layers (their inputs need no gradient: the embedding is frozen) give the adapters the same update."""
    plain, recompute = _trainer(), _trainer(activation_checkpointing=True)
    a, b = plain.step(_batch()), recompute.step(_batch())
    assert a["policy_loss"] == b["policy_loss"] and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    after = recompute.engine_weights()
    for k, v in plain.engine_weights().items():
        torch.testing.assert_close(after[k], v, rtol=1e-6, atol=1e-8, msg=k)


@pytest.mark.parametrize("change", [{"optim": OptimConfig(name="muon")}, {"mxfp8": True}])
def test_lora_refuses_muon_and_mxfp8(change):
    with pytest.raises(ValueError, match="lora trains its adapters with AdamW"):
        TrainConfig(lora=LORA, **change)
    with pytest.raises(ValueError, match="lora.rank"):
        LoraConfig(enabled=True, rank=0)


def test_a_lora_push_sends_only_the_adapter_and_the_engine_then_samples_the_trainers_policy():
    """The engine holds the base with the same adapter attached (B = 0: it samples the base); after a step, a push of
    `engine_weights` (what the loop's in-process transport hands the engine) carries only the adapter, advances the
    version, and the engine's log-probabilities of its own greedy tokens equal the trainer's model's."""
    trainer = _trainer(seed=1, lr=5e-2)
    base, tok = tiny_model(seed=1)
    engine = LocalEngine(attach(base.float(), LORA), tok)
    prompt = list(tok.encode("def roman(n):\n    ", add_special_tokens=False))
    request = GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=0.0))

    def engine_vs_trainer() -> tuple[torch.Tensor, torch.Tensor]:
        got = engine.generate([request])[0]
        return torch.tensor(got.logprobs), _logprobs(trainer.model, prompt + got.token_ids, len(prompt))

    sampled, trained = engine_vs_trainer()
    torch.testing.assert_close(sampled, trained, rtol=0, atol=1e-5)  # at the start both are the base
    for _ in range(2):
        trainer.step(_batch())
    sampled, trained = engine_vs_trainer()
    assert (sampled - trained).abs().max() > 1e-3  # the trainer moved; the engine has not been told
    pushed = trainer.engine_weights()
    assert pushed and all(is_adapter(k) for k in pushed)
    engine.update_weights(trainer.version, pushed)
    assert engine.policy_version == trainer.version == 2
    sampled, trained = engine_vs_trainer()
    torch.testing.assert_close(sampled, trained, rtol=0, atol=1e-5)
    # as a payload (the HTTP and Ray path): bf16 tensors, far fewer bytes than the model's
    stats = sync(pushed, 3, engine=engine)
    assert engine.policy_version == 3 and stats.tensors == len(pushed)
    assert stats.bytes * 5 < len(encode(trainer.full_state_dict(), 3))
    sampled, trained = engine_vs_trainer()
    torch.testing.assert_close(sampled, trained, rtol=0, atol=2e-2)  # the adapter rounded to bf16


def test_make_engine_attaches_the_adapter_a_push_needs():
    engine = make_engine(TINY, lora=LORA)
    try:
        names = set(engine.model.state_dict())
        assert set(_trainer(seed=0).engine_weights()) <= names
        with pytest.raises(KeyError, match="does not have"):  # without the adapter a push is refused whole
            LocalEngine(tiny_model()[0], tiny_model()[1]).update_weights(1, _trainer(seed=0).engine_weights())
    finally:
        engine.close()


def test_an_export_that_would_not_fit_is_refused_and_the_last_one_kept(tmp_path, monkeypatch):
    """As a checkpoint: the space the export's tensors need is checked before anything is written. The free space
    is the one thing faked."""
    from shipyard.train import checkpoint

    trainer = _trainer(seed=1, lr=5e-2)
    trainer.step(_batch())
    tok = tiny_model()[1]
    export_policy(trainer, trainer.export_weights(), tok, tmp_path / "export")
    before = (tmp_path / "export" / "model.safetensors").read_bytes()
    trainer.step(_batch())
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: len(before) // 2)
    with pytest.raises(checkpoint.CheckpointSpaceError, match=r"the export of step 2 needs ~.* MiB in .* free"):
        export_policy(trainer, trainer.export_weights(), tok, tmp_path / "export")
    assert (tmp_path / "export" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_the_export_is_the_merged_model_that_plain_transformers_loads(tmp_path):
    """The export's logits equal the trained (unmerged) model's; its file holds plain names only; and the
    checkpoint's adapter, loaded by peft onto the base and merged by peft's own `merge_and_unload`, gives the same
    weights: the adapter files are peft's format."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = _trainer(seed=1, lr=5e-2)
    for _ in range(2):
        trainer.step(_batch())
    tok = tiny_model()[1]
    export_policy(trainer, trainer.export_weights(), tok, tmp_path / "export")
    names = set(load_file(tmp_path / "export" / "model.safetensors"))
    assert not any("lora" in n or "base_layer" in n for n in names) and "model.layers.0.mlp.up_proj.weight" in names
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert exported.dtype == torch.float32
    ids = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        torch.testing.assert_close(exported(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)

    path = save_checkpoint(trainer, tmp_path / "ckpt")
    peft_model = PeftModel.from_pretrained(tiny_model(seed=1)[0].float(), path)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
    merged = peft_model.merge_and_unload().state_dict()
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-5, atol=1e-6, msg=name)


def _resumable() -> Trainer:
    """bf16 base, an EMA teacher (distillation on: the batches carry no hints, the EMA still follows the policy) and a
    KL reference: every module a LoRA checkpoint holds."""
    model, tok = tiny_model(seed=4)
    config = TrainConfig(optim=OptimConfig(lr=1e-2, warmup_steps=3), micro_batch=1, compute_dtype="bfloat16",
                         lora=LORA, policy=PolicyLossConfig(kl_coef=0.1),
                         distill=DistillConfig(enabled=True, weight=0.3, teacher="ema", ema_decay=0.9))
    return Trainer(model.float(), config, pad_id=tok.pad_token_id,
                   header_ids=ChatFormat(tok, default_tools()).assistant_header_ids())


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_bit_identically(tmp_path):
    straight = _resumable()
    batches = [_batch(seed) for seed in range(4)]
    want = [straight.step(b) for b in batches]

    first = _resumable()
    for b in batches[:2]:
        first.step(b)
    path = save_checkpoint(first, tmp_path / "ckpt")
    assert not (path / "model.safetensors").exists() and (path / ADAPTER_CONFIG).exists()
    adapter = load_file(path / ADAPTER_WEIGHTS)
    pushed = first.engine_weights()
    assert len(adapter) == len(pushed) and all(k.startswith("base_model.model.") for k in adapter)
    saved = dcp.FileSystemReader(path / "dcp").read_metadata().state_dict_metadata
    weights = [k for k in saved if k.split(".", 1)[0] in ("model", "ema", "reference")]
    assert weights and all(is_adapter(k) for k in weights)  # no frozen base tensor in the checkpoint

    resumed = _resumable()
    load_checkpoint(resumed, path)
    assert resumed.version == 2
    got = [resumed.step(b) for b in batches[2:]]
    for module in ("model", "ema", "reference"):
        a, b = getattr(straight, module).state_dict(), getattr(resumed, module).state_dict()
        assert all(torch.equal(v, b[k]) for k, v in a.items()), module
    for a, b in zip(want[2:], got, strict=True):
        assert (a["policy_loss"], a["ref_kl"], a["grad_norm"]) == (b["policy_loss"], b["ref_kl"], b["grad_norm"])

    full = Trainer(tiny_model(seed=4)[0].float(), TrainConfig(optim=OptimConfig(lr=1e-2), micro_batch=1,
                                                              policy=PolicyLossConfig(kl_coef=0.1),
                                                              distill=DistillConfig(enabled=True, weight=0.3)),
                   pad_id=first.pad_id)
    with pytest.raises(UsageError, match=r"\[trainer.lora\] \{'rank': 4, 'alpha': 8.0\} but this trainer has off"):
        load_checkpoint(full, path)


def _ranks_worker(rank, world, ckpt, out):
    """One LoRA step on `world` ranks, a checkpoint, a second step; rank 0 saves what the engines would get."""
    trainer = _trainer(seed=2)
    trainer.step(_batch())
    save_checkpoint(trainer, ckpt)
    metrics = trainer.step(_batch())
    bf16 = _trainer(seed=2, compute_dtype="bfloat16").step(_batch())  # bf16 base + float32 adapters
    pushed, export = trainer.engine_weights(), trainer.export_weights()
    if rank == 0:
        torch.save({"pushed": {k: v.clone() for k, v in pushed.items()}, "metrics": metrics, "bf16": bf16,
                    "export": {k: v.clone() for k, v in export.items()}}, out)


def test_lora_on_two_gloo_ranks_trains_like_one_and_its_checkpoint_resumes_on_one():
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run_ranks(_ranks_worker, 2, str(tmp / "ckpt"), str(tmp / "two.pt"))
        two = torch.load(tmp / "two.pt")
        one = _trainer(seed=2)
        one.step(_batch())
        metrics = one.step(_batch())
        resumed = _trainer(seed=2)
        load_checkpoint(resumed, tmp / "ckpt" / "step-00000001")
        resumed.step(_batch())
    assert two["metrics"]["policy_loss"] == pytest.approx(metrics["policy_loss"], rel=1e-4, abs=1e-6)
    assert two["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4)
    bf16 = _trainer(seed=2, compute_dtype="bfloat16").step(_batch())
    assert two["bf16"]["policy_loss"] == pytest.approx(bf16["policy_loss"], rel=0.05, abs=1e-4)
    for trained in (one, resumed):
        pushed = trained.engine_weights()
        assert set(pushed) == set(two["pushed"])
        for k, v in pushed.items():
            torch.testing.assert_close(two["pushed"][k], v, rtol=1e-4, atol=1e-6, msg=k)
    export = one.export_weights()
    assert set(export) == set(two["export"])
    for k, v in export.items():
        torch.testing.assert_close(two["export"][k], v, rtol=1e-4, atol=1e-6, msg=k)
