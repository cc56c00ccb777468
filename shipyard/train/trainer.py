"""The trainer: one RL step from a `Batch` — policy loss, targeted self-distillation, Muon/AdamW, FSDP2.

One code path for 1 and N processes: the trainer always runs in a process group (a single-process gloo group over
an in-memory store is made when none exists). Every rank gets the same global batch and takes its share of the rows,
balanced by tokens (`packing.balance`; any batch size on any number of ranks); loss denominators (tokens,
sequences, distillation tokens) are all-reduced first, so the sum of the ranks' losses is exactly the full-batch
loss, and the local loss is multiplied by N because data parallelism averages gradients over ranks. With N > 1
the model is sharded with FSDP2 (`fully_shard` per decoder layer, then the root), whose mixed precision policy
gathers bf16 weights for `compute_dtype = "bfloat16"`. A data-parallel degree of 1 applies no FSDP,
as torchtitan does (`fsdp_enabled` is false at degree 1; mixed precision then comes from `torch.autocast`): FSDP2
at one rank still copies every parameter into and out of its all-gather buffer twice a step and every gradient
through its reduce-scatter buffer — about a third of a CPU step for Qwen2.5-0.5B, for nothing.

The module given to `Trainer` is trained in place and nothing else about it is changed: it must hold float32
parameters on the trainer's device (the master weights; `compute_dtype` sets the math), else the trainer refuses it
and says how to fix it; `in_place = False` trains a float32 copy and leaves the caller's module untouched. Only a
config that asks for it converts anything (`mxfp8` swaps the linear layers of the module being trained; `lora`
attaches adapters to them and freezes the rest). The teacher for hint self-distillation (by default an EMA copy of
the whole model) is built only with `distill.enabled` — the RL loop sets it when hints are on — and a batch with hints
is refused otherwise. The optimizer defaults to AdamW, the fast choice on CPU; GPU configs choose Muon
(`default_optimizer`). Samples whose reward is unknown are not computed.

**LoRA** (`lora.enabled`, `shipyard.models.lora`). Adapters on every linear layer of the blocks; the base is frozen
and held in the compute dtype (bf16 with `compute_dtype = "bfloat16"`: half the memory of float32 master weights,
and no gradients or optimizer state for it), the adapters in float32. Only the adapters get gradients and optimizer
state, and always AdamW: Muon's orthogonalized update of a rank-r factor sets all r singular values alike, its
per-head units do not apply to A and B, and LoRA's recipes (Hu et al. 2021; "LoRA Without Regret", Thinking Machines
2025 — rank 1 matched full fine-tuning in RL at ~10× its learning rate) are AdamW's. The EMA teacher and the KL
reference share the frozen base with the policy (on one rank) and copy only the adapters. The module given may hold
any floating dtype (`TrainConfig.load_dtype` is the one that needs no conversion). `engine_weights` is then the
adapter alone (the engines attach the same adapter: a push is a few MB) and `export_weights` the base with the
adapter merged in, a plain transformers state dict.

A step:
1. each row cut after its last trained token (`Batch.trimmed`: an episode's last observation is never trained on and can
   run past the context budget, so a row is at most `max_tokens` of its episode); micro-batches of at most `micro_batch`
   rows and, with `micro_batch_tokens` > 0, at most that many *unique* tokens (`prefix.micro_batches`: rows sharing a
   prompt stay together and count it once; activation memory bounded by tokens). A micro-batch's shared prefixes are
   computed once, with their gradient accumulated from every row (`prefix.forward_cascade`: the prefixes in one call,
   the rows' own tokens in a second against the prefixes' keys and values; exact; a step's cost follows the unique
   tokens, reported as `forward_tokens`). Every rank runs as many micro-batches as the busiest rank — the others add a
   two-token micro-batch that counts for nothing — so the FSDP collectives stay in step. Per micro-batch: forward,
   per-token log-probabilities and entropies, the policy loss (`losses.policy_loss`; one optimizer step per batch, so
   π_old = π_θ and the importance weights carry the sampler/trainer mismatch), the k3 KL to the frozen initial policy
   when `kl_coef > 0` — or, with `objective = "cross_entropy"` (supervised fine-tuning on demonstrations, `shipyard
   sft`), the negative log-likelihood −log π_θ(y_t) of the same loss-masked tokens, aggregated the same way: one
   trainer, one batch format, one set of checkpoints for the cold start and for RL;
2. for rows with hints (`distill.enabled`): the teacher (EMA of the policy by default, frozen initial weights, or
   the live policy) runs without gradient on the hinted contexts (`distill.teacher_logits_at_hints`);
   `distill.distill_term` on the target turn's tokens, weight λ, hints without lift dropped. Every rank runs the
   teacher on every micro-batch (a two-token stand-in when it has no hint) so the FSDP collectives stay in step;
3. gradient clipping, Muon (matrices; q/k/v per head, experts per expert) + AdamW (embeddings, head, norms,
   biases) or AdamW alone, the LR schedule, the EMA teacher update, policy version + 1. On CPU the C heap is held to
   glibc's initial mmap threshold during the step and trimmed after it (`memory.step_heap`), so resident memory follows
   the live tensors, not the step's tokens.

`train_step(trajectories, advantages, …)` is the Python API the rollout server calls.
"""

from __future__ import annotations

import copy
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from shipyard.harness.trajectory import Trajectory
from shipyard.models.dtype import resolve_dtype
from shipyard.models.lora import LoraConfig, attach, is_adapter, merged
from shipyard.rollout.record import Hint
from shipyard.train.batch import Batch
from shipyard.train.distill import DistillConfig, distill_term, teacher_logits_at_hints
from shipyard.train.losses import PolicyLossConfig, aggregate, policy_loss, token_logprobs
from shipyard.train.memory import step_heap
from shipyard.train.muon import Muon, muon_param_groups
from shipyard.train.mx import convert_to_mxfp8
from shipyard.train.packing import balance
from shipyard.train.prefix import forward_layout, layout, micro_batches, supports_cascade


def default_optimizer(device: str) -> Literal["muon", "adamw"]:
    """The fast choice per device, for config trees: AdamW on CPU (Muon's Newton–Schulz iterations cost 23–25 s a
    step for the 0.5B on 2 cores, AdamW 0.35 s), Muon on accelerators, where the iterations are cheap matmuls."""
    return "adamw" if torch.device(device).type == "cpu" else "muon"


@dataclass
class OptimConfig:
    name: Literal["muon", "adamw"] = "adamw"  # CPU default; GPU configs choose "muon" (`default_optimizer`)
    lr: float = 2e-6  # Muon's 0.2·√max(r, c) scaling lets it share AdamW's learning rate
    weight_decay: float = 0.1
    momentum: float = 0.95
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    grad_clip: float = 1.0
    per_head: bool = True

    def __post_init__(self) -> None:
        if self.name not in ("muon", "adamw"):
            raise ValueError(f"unknown optimizer {self.name!r}: muon or adamw")
        if self.lr <= 0 or self.grad_clip <= 0 or self.warmup_steps < 0:
            raise ValueError("lr and grad_clip must be > 0, warmup_steps >= 0")


@dataclass
class TrainConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    micro_batch: int = 4  # rows per micro-batch
    micro_batch_tokens: int = 0  # tokens per micro-batch (0: no limit); a longer row runs alone
    # Recompute each decoder layer's activations in the backward pass instead of keeping them (transformers models):
    # activation memory of one layer instead of all, for ~30% more compute. On CPU the shared-prefix rows' attention
    # is materialized (seq² per head per layer), so long groups need it on a small machine.
    activation_checkpointing: bool = False
    mxfp8: bool = False
    # bfloat16: FSDP2 mixed precision (autocast on one rank), fp32 master weights; "auto": bfloat16 where the trainer's
    # device has bf16 arithmetic, else float32 (`shipyard.models.dtype.native_bfloat16`: on an AVX2-only CPU bf16
    # matmuls are hundreds of times slower)
    compute_dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    seed: int = 0
    # Rows of a micro-batch sharing at least this many leading tokens (a group's prompt) compute them once
    # (`shipyard.train.prefix`); 0: every row computes its whole sequence.
    shared_prefix: int = 32
    # The module passed to `Trainer` is trained in place (its float32 parameters change at every step; nothing
    # else about it is converted). False: the trainer trains a float32 copy and the caller's module is untouched.
    in_place: bool = True
    # LoRA adapters instead of full fine-tuning ([trainer.lora]; off by default).
    lora: LoraConfig = field(default_factory=LoraConfig)
    # What a step minimises: "policy_gradient" (RL: `losses.policy_loss` with the rows' advantages) or
    # "cross_entropy" (supervised fine-tuning, `shipyard sft`: the negative log-likelihood of the loss-masked tokens —
    # the policy's own turns of a demonstration — aggregated like the policy loss; advantages and sampler
    # log-probabilities are not read).
    objective: Literal["policy_gradient", "cross_entropy"] = "policy_gradient"

    def __post_init__(self) -> None:
        if self.objective not in ("policy_gradient", "cross_entropy"):
            raise ValueError(f"objective must be policy_gradient or cross_entropy, got {self.objective!r}")
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens must be >= 0 (0: no token limit), got {self.micro_batch_tokens}")
        if self.compute_dtype not in ("float32", "bfloat16", "auto"):
            raise ValueError(f"compute_dtype must be float32, bfloat16 or auto, got {self.compute_dtype!r}")
        if self.shared_prefix < 0:
            raise ValueError(f"shared_prefix must be >= 0 (0: no sharing), got {self.shared_prefix}")
        if self.lora.enabled and (self.optim.name != "adamw" or self.mxfp8):
            raise ValueError("lora trains its adapters with AdamW, on the model's own linear layers: set optim.name = "
                             "\"adamw\" and mxfp8 = false with lora.enabled (shipyard.train.trainer: why not Muon)")

    @property
    def load_dtype(self) -> torch.dtype:
        """The dtype to hand the trainer its model in: float32 master weights; with LoRA the frozen base's dtype,
        the compute dtype (the adapters are made in float32 whatever the base's). An unresolved "auto" loads float32
        and the trainer converts the base; a run resolves it first (`shipyard.rl.ranks.RankSpec.of`)."""
        return torch.bfloat16 if self.lora.enabled and self.compute_dtype == "bfloat16" else torch.float32


def ensure_process_group() -> None:
    """A process group for the trainer: the existing one, or a single-process gloo group (no network)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _shard(model: nn.Module, mesh, compute_dtype: str) -> nn.Module:
    """FSDP2 per decoder layer, then the root, when there is more than one rank. bfloat16 compute: parameters are
    gathered in bf16 for forward and backward, gradients reduced in float32 into the float32 master weights the
    optimizer updates."""
    if mesh.size() == 1:
        return model
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if compute_dtype == "bfloat16" else None,
                                  reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _checkpointed_forward(layer: nn.Module, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(type(layer).forward, layer, *args, use_reentrant=False, **kwargs)


def _recompute_activations(model: nn.Module) -> None:
    """Activation checkpointing per decoder layer (non-reentrant, so it composes with FSDP2: the layer's FSDP hooks
    stay outside the recomputed region, as in torchtitan). Not transformers' own `activation_checkpointing_enable`:
    that drops the key/value cache inside each layer, and the shared-prefix layout passes the prefix's keys and
    values to the suffix call through one (`prefix.forward_cascade`; its caches are safe to recompute)."""
    from transformers import PreTrainedModel

    layers = model.get_decoder().layers if isinstance(model, PreTrainedModel) else None
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"activation_checkpointing needs a transformers decoder with a `layers` list; got "
                         f"{type(model).__name__}: set trainer.activation_checkpointing = false")
    for layer in layers:
        layer.forward = types.MethodType(_checkpointed_forward, layer)  # a deep copy rebinds it to the copy


def _adder(sums: dict[str, float]):
    def add(key: str, value: float) -> None:
        sums[key] = sums.get(key, 0.0) + value
    return add


def _reshard(module: nn.Module) -> None:
    """Free a forward-only FSDP module's gathered weights: FSDP2 keeps the root's parameters unsharded after
    forward (expecting a backward), and until resharded they are plain tensors that an in-place update (the EMA)
    or a state_dict would see instead of the shards."""
    if isinstance(module, FSDPModule):
        module.reshard()


def _dense(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """[B, T] zeros with `values` (flattened, row-major) at the True positions of `where`; differentiable."""
    return values.new_zeros(where.shape).masked_scatter(where, values)


def _idle_batch(pad_id: int, device: torch.device) -> Batch:
    """Two tokens of one failed sample (`sample_mask` 0): a forward and backward that change nothing, for a rank with
    fewer micro-batches than another, whose FSDP all-gathers and reduce-scatters must still be matched (two tokens:
    the shared-prefix layout makes its two model calls for it too)."""
    one = torch.ones(1, 2, dtype=torch.long, device=device)
    zero = torch.zeros(1, 2, device=device)
    return Batch(one * pad_id, one, zero, zero, zero, one * 0, torch.zeros(1, device=device), [], pad_id)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Trainer:
    def __init__(self, model: nn.Module, config: TrainConfig, *, pad_id: int, header_ids: Sequence[int] = (),
                 device: str = "cpu"):
        ensure_process_group()
        dtype = resolve_dtype(config.compute_dtype, device)
        config = replace(config, compute_dtype=dtype)
        self.config, self.pad_id, self.header_ids = config, pad_id, tuple(header_ids)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.device = torch.device(device)
        torch.manual_seed(config.seed)
        model = self._own(model, config)
        if config.lora.enabled:
            self._adapt(model)
        if self.world > 1:  # every rank starts from rank 0's weights, however each rank got its copy
            with torch.no_grad():
                for t in model.state_dict().values():
                    dist.broadcast(t, src=0)
        if config.mxfp8:
            convert_to_mxfp8(model)
        if config.activation_checkpointing:
            _recompute_activations(model)
        model.train()
        self.distilling = config.distill.enabled and config.distill.weight > 0
        needs_ref = config.policy.kl_coef > 0 or (self.distilling and config.distill.teacher == "frozen")
        teacher = self._frozen_copy(model) if self.distilling and config.distill.teacher == "ema" else None
        reference = self._frozen_copy(model) if needs_ref else None
        self.mesh = init_device_mesh(self.device.type, (self.world,))
        dtype = config.compute_dtype
        self.model = _shard(model, self.mesh, dtype)
        self.ema = _shard(teacher, self.mesh, dtype) if teacher is not None else None
        self.reference = _shard(reference, self.mesh, dtype) if reference is not None else None
        # bfloat16 compute without FSDP (one rank): autocast; with FSDP its mixed-precision policy does it.
        self.autocast = torch.autocast(self.device.type, torch.bfloat16,
                                       enabled=dtype == "bfloat16" and self.world == 1)
        # Shared prefixes need a custom 4-D attention mask; other attention kernels get rows one by one.
        self.shared_prefix = config.shared_prefix if supports_cascade(self.model) else 0
        self.optimizers = self._optimizers()
        warmup = config.optim.warmup_steps
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / (warmup + 1)))
                           for o in self.optimizers]
        self.version = 0
        self.step_count = 0
        self._gathered: dict[bool, dict[str, torch.Tensor]] = {}  # this version's full weights, on rank 0

    # Set-up --------------------------------------------------------------------------------------------------
    def _own(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        """The module to train: the caller's, as given (`in_place`), or a float32 copy on the trainer's device. The
        caller's module is never converted behind its back: float32 master weights on the trainer's device are
        required in place, with a message saying how to get them."""
        if not config.in_place:
            return copy.deepcopy(model).to(self.device, config.load_dtype)
        wrong = {(p.dtype, p.device.type) for p in model.parameters()} - {(torch.float32, self.device.type)}
        if config.lora.enabled:  # the base is converted as [trainer.lora] asks: any floating dtype will do
            wrong = {(d, dev) for d, dev in wrong if not d.is_floating_point or dev != self.device.type}
        if wrong:
            dtype, device = sorted(wrong, key=str)[0]
            raise ValueError(f"the model has {dtype} parameters on {device}; the trainer keeps float32 master weights "
                             f"on {self.device.type} (compute_dtype sets the math) and trains the module it is given "
                             f"in place: load it as float32 on {self.device.type} (e.g. load_hf(name, "
                             f"dtype=torch.float32)), or set in_place = false to train a float32 copy")
        return model

    def _adapt(self, model: nn.Module) -> None:
        """LoRA: adapters attached to the module (in place, as the config asks), float32; every other parameter frozen
        in the compute dtype."""
        attach(model, self.config.lora)
        base = self.config.load_dtype
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(torch.float32 if p.requires_grad else base)

    def _frozen_copy(self, model: nn.Module) -> nn.Module:
        """A frozen copy of the model for the teacher or the reference. With LoRA on one rank the frozen base is shared,
        not copied (it never changes): only the adapters are the copy's own. FSDP shards each module's parameters
        itself, so with N ranks the copy is whole."""
        shared = {id(p): p for p in model.parameters() if not p.requires_grad} if self.world == 1 else {}
        return copy.deepcopy(model, shared).eval().requires_grad_(False)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        o = self.config.optim
        if o.name == "adamw":  # the trainable parameters: all, or with LoRA the adapters
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            return [torch.optim.AdamW(trainable, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                      fused=True)]
        muon_groups, adamw_groups = muon_param_groups(self.model, per_head=o.per_head)
        opts: list[torch.optim.Optimizer] = [Muon(muon_groups, lr=o.lr, weight_decay=o.weight_decay,
                                                  momentum=o.momentum)]
        if adamw_groups:
            opts.append(torch.optim.AdamW(adamw_groups, lr=o.lr, betas=o.betas, eps=o.eps,
                                          weight_decay=o.weight_decay, fused=True))
        return opts

    @property
    def teacher(self) -> nn.Module:
        kind = self.config.distill.teacher
        return self.ema if kind == "ema" else self.reference if kind == "frozen" else self.model

    # The step ----------------------------------------------------------------------------------------------------
    def _sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def train_step(self, trajectories: list[Trajectory], advantages: list[float], *, failed: list[bool] | None = None,
                   hints: Sequence[Hint] = ()) -> dict[str, float]:
        """One RL step from trajectories (the rollout server's call): batch them and `step`."""
        batch = Batch.from_trajectories(trajectories, advantages, pad_id=self.pad_id, failed=failed, hints=hints,
                                        header_ids=self.header_ids)
        return self.step(batch)

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch` (the same global batch on every rank); metrics for the whole batch."""
        self.weights_changed()  # the last version's gathered copy is not kept through this step's peak
        start = time.perf_counter()
        policy = self.config.policy
        if policy.norm_length is None:  # Dr. GRPO's L, unset: the batch's padded length as given, not as trimmed
            policy = replace(policy, norm_length=batch.input_ids.shape[1] - 1)
        batch = batch.trimmed()
        # Failed samples, and rows with nothing trained (e.g. every token stale), count for nothing, so they are not
        # computed at all (nor can they change how the others are laid out); the rest is split over ranks by tokens —
        # the same plan on every rank: no communication.
        useful = batch.trained().any(-1).tolist()
        live = [i for i, m in enumerate(batch.sample_mask.tolist()) if m > 0 and useful[i]]
        lengths = batch.attention_mask[live].sum(-1).tolist()
        shares = [[live[i] for i in share] for share in balance(lengths, self.world)]
        full = batch.attention_mask.sum(-1).tolist()
        plans = [micro_batches(batch.input_ids[share], [full[i] for i in share], self.config.micro_batch,
                               self.config.micro_batch_tokens, self.shared_prefix) for share in shares]
        local = batch.rows(shares[self.rank]).to(self.device)
        mask = local.loss_mask[:, 1:] * local.sample_mask[:, None]
        per_seq = self.config.policy.aggregation != "token_mean"
        hint_tokens = sum(h.end - h.start for h in local.hints if local.sample_mask[h.sample] > 0)
        if batch.hints and not self.distilling:
            raise ValueError("the batch carries hints but distillation is off: set distill.enabled = true (and "
                             "distill.weight > 0) in the trainer config when hints are on, so the teacher is built")
        den, dden = self._sum([float((mask.sum(-1) > 0).sum() if per_seq else mask.sum()), float(hint_tokens)])
        if den == 0 and dden == 0:  # every sample failed or sampled nothing: no step, no new version
            return {"skipped": 1.0, "tokens": 0.0, "version": float(self.version),
                    "seconds": time.perf_counter() - start}
        sums: dict[str, float] = {}
        with step_heap(self.device.type == "cpu"):
            for rows in plans[self.rank]:
                self._micro(local.rows(rows), den, dden, sums, policy)
            for _ in range(max(len(p) for p in plans) - len(plans[self.rank])):
                self._micro(_idle_batch(self.pad_id, self.device), den, dden, sums, policy)
            params = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.optim.grad_clip)
            for opt in self.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            for sched in self.schedulers:
                sched.step()
            self._update_ema()
        self.version += 1
        self.step_count += 1
        self.weights_changed()
        keys = sorted(sums)
        if self.world > 1:  # a rank without hinted rows has no distillation figures: agree on the keys first
            everyone: list[list[str]] = [[] for _ in range(self.world)]
            dist.all_gather_object(everyone, keys)
            keys = sorted({k for ks in everyone for k in ks})
        totals = dict(zip(keys, self._sum([sums.get(k, 0.0) for k in keys]), strict=True))
        tokens = max(totals.pop("tokens", 0.0), 1.0)
        dtok = totals.pop("distill_tokens", 0.0)
        forward = totals.pop("forward_tokens", 0.0)
        scale = {"t": tokens, "d": max(dtok, 1.0), "s": 1.0}
        metrics = {k[2:]: v / scale[k[0]] for k, v in totals.items()}
        for key in [k for k in metrics if k.startswith("hint_lift_sum")]:  # per hint kind: the mean lift
            suffix = key.removeprefix("hint_lift_sum")
            metrics["hint_lift" + suffix] = metrics.pop(key) / max(metrics.get("hints" + suffix, 0.0), 1.0)
        seconds = time.perf_counter() - start
        norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        metrics |= {"grad_norm": float(norm), "tokens": tokens, "distill_tokens": dtok, "forward_tokens": forward,
                    "seconds": seconds, "tokens_per_second": tokens / seconds, "version": float(self.version),
                    "lr": self.schedulers[0].get_last_lr()[0]}
        return metrics

    def _micro(self, mb: Batch, den: float, dden: float, sums: dict[str, float],
               policy: PolicyLossConfig | None = None) -> None:
        cfg = self.config
        policy = policy or cfg.policy
        distilling = self.distilling and dden > 0
        teacher_logits = None
        if distilling:
            teacher_logits = teacher_logits_at_hints(self.teacher, mb, self.pad_id, self.shared_prefix, self.autocast)
            if self.teacher is not self.model:
                _reshard(self.teacher)
        # Logits only where a sampled token is predicted (position t − 1 for token t): the output head and the
        # log-softmax over the vocabulary are skipped for prompts and observations — in agent trajectories most of
        # the sequence. They come back flattened, [N, V], in row-major order.
        mask = mb.loss_mask[:, 1:] * mb.sample_mask[:, None]
        keep = torch.zeros_like(mb.attention_mask, dtype=torch.bool)
        keep[:, :-1] = mask > 0
        targets = mb.input_ids[:, 1:][keep[:, :-1]]
        packed = layout(mb.input_ids, mb.attention_mask, self.pad_id, self.shared_prefix)
        ref_lp = None
        if self.reference is not None and cfg.policy.kl_coef > 0:
            with torch.no_grad(), self.autocast:
                ref = forward_layout(self.reference, packed, keep)
                ref_lp = _dense(token_logprobs(ref[None], targets[None])[0][0], keep[:, :-1])
            _reshard(self.reference)
        with self.autocast:
            logits = forward_layout(self.model, packed, keep)
        flat_lp, flat_entropy = token_logprobs(logits[None], targets[None])
        lp = _dense(flat_lp[0], keep[:, :-1])
        n = float(mask.sum())
        if cfg.objective == "cross_entropy":
            loss = aggregate(-lp, mask, policy.aggregation, policy.norm_length, den)
            metrics = {"nll": float((-lp.detach() * mask).sum()) / max(n, 1.0)}
        else:
            loss, metrics = policy_loss(lp, lp.detach(), mb.sampler_logprobs[:, 1:], mb.advantages[:, 1:], mask,
                                        policy, ref_lp, denominator=den)
        add = _adder(sums)
        for k, v in metrics.items():
            if k != "tokens":
                add("t:" + k, v * n)
        add("t:entropy", float(flat_entropy.sum()))
        add("tokens", n)
        add("forward_tokens", float(packed.tokens))
        add("s:sft_loss" if cfg.objective == "cross_entropy" else "s:policy_loss",
            float(loss.detach()))  # micro-batch losses sum to the full-batch loss
        if distilling:
            loss = loss + distill_term(mb, logits, keep, teacher_logits, dden, cfg.distill, add)
        (loss * self.world).backward()

    @torch.no_grad()
    def _update_ema(self) -> None:
        if self.ema is None:
            return
        decay = self.config.distill.ema_decay
        for t, p in zip(self.ema.parameters(), self.model.parameters(), strict=True):
            if p.requires_grad:  # a frozen parameter (LoRA's base) is the policy's own, or equal to it
                _local(t).lerp_(_local(p).to(t.dtype), 1 - decay)

    # Weights -----------------------------------------------------------------------------------------------------
    def weights_changed(self) -> None:
        """Forget the weights gathered for the version before (a step, a checkpoint loaded)."""
        self._gathered.clear()

    def full_state_dict(self, adapter_only: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded weights, or with `adapter_only` the LoRA adapter's alone (collective: every rank calls it).

        Gathered to rank 0 alone, one tensor at a time, and kept on its CPU (`get_model_state_dict` with
        `full_state_dict` and `cpu_offload`): no rank holds a second full copy of the model on its device, and the
        other ranks get `{}`. Gathered once per version: the push, the checkpoint and the export of one step share the
        copy (`weights_changed` forgets it), so callers read it and never change it (a key added or a tensor written
        in place would reach the others). On one rank the tensors are the parameters themselves. Tied weights (the
        head and the embedding) come back as one tensor under both names."""
        if adapter_only in self._gathered:
            return self._gathered[adapter_only]
        first: dict[int, str] = {}  # tied parameters are one parameter under several names; FSDP2's state_dict
        alias = {name: first.setdefault(id(p), name)  # gives each name its own DTensor, so tie by the parameters
                 for name, p in self.model.named_parameters(remove_duplicate=False)}
        if self.world > 1:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapter_only)
            gathered = get_model_state_dict(self.model, options=options)  # {} on ranks other than 0
        else:
            gathered = {k: v.detach() for k, v in self.model.state_dict().items()}
        full: dict[str, torch.Tensor] = {}
        out = {k: full.setdefault(alias.get(k, k), v) for k, v in gathered.items()
               if not adapter_only or is_adapter(k)}
        self._gathered[adapter_only] = out
        return out

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """What a weight push sends the engines (collective): every weight, or with LoRA the adapter's tensors only,
        under the adapted model's state-dict names — an engine with the same adapter attached
        (`make_engine(..., lora=…)`) loads them as they are."""
        return self.full_state_dict(adapter_only=self.config.lora.enabled)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """A plain transformers state dict of the policy (collective): the full weights, or with LoRA the base with
        the adapter merged in (float32; `shipyard.models.lora.merged`), which transformers loads without peft."""
        full = self.full_state_dict()
        return merged(self.model, full) if self.config.lora.enabled and full else full
