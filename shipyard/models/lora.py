"""LoRA adapters: one shape of low-rank adapter shared by the trainer and the engines that sample for it.

LoRA (Hu et al. 2021, arXiv 2106.09685) trains, for each adapted linear layer y = W x, two small matrices
A ∈ ℝ^{r×in} and B ∈ ℝ^{out×r} and computes

    y = W x + (α / r) · B A x         W frozen; A random (Kaiming-uniform), B = 0 at the start, so ΔW = 0

The adapter is attached to *every* linear layer of the transformer blocks (peft's `target_modules="all-linear"`:
q/k/v/o and the MLP's gate/up/down, not the output head), which is what "LoRA Without Regret" (Thinking Machines,
2025, https://thinkingmachines.ai/blog/lora/) found necessary for LoRA to match full fine-tuning — attention-only
LoRA falls short — and where it found rank 1 enough for RL, with a learning rate ~10× full fine-tuning's (the 1/r
factor makes the best learning rate nearly independent of the rank).

**Why one module for both sides.** The trainer (`shipyard.train.trainer`, `[trainer.lora]`) and an in-process engine
(`shipyard.models.resolve.make_engine(..., lora=…)`) attach the same adapter with `attach`, through peft's
`inject_adapter_in_model`: the model stays the transformers model it was (its modules and state-dict names are
the base's, each adapted layer becoming `<layer>.base_layer` + `<layer>.lora_A.default` / `.lora_B.default`), so
the trainer's FSDP, activation checkpointing and shared-prefix code see the model they know. A weight push then
carries only the adapter's tensors (`adapter_tensors`, a few MB instead of the model) under those state-dict names,
and the engine loads them with its ordinary `update_weights`: the sampler computes W x + (α/r)·B A x with the
trainer's own A and B — the same function, not a merged approximation (merging into bf16 weights would round away
updates smaller than W's last bit, and would need a pristine copy of W to merge the next version into).

**Files.** `peft_files` writes an adapter as peft saves one (`adapter_model.safetensors` with names
`base_model.model.<module>.lora_A.weight`, and `adapter_config.json`): `PeftModel.from_pretrained(base, DIR)` and
vLLM's `--lora-modules` / `/v1/load_lora_adapter` read it. `merged` folds the adapter into the base — W + (α/r)·B A
in float32 — for an export that plain transformers loads without peft.

peft is imported only by the functions that need it, not by reading a configuration.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ADAPTER = "default"  # peft's adapter name: it appears in the state-dict names (`<layer>.lora_A.default.weight`)
TARGET = "all-linear"  # every linear layer of the transformer blocks (peft excludes the output head)
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # peft's file names
PEFT_PREFIX = "base_model.model."  # how peft's files name a module of the base model


@dataclass
class LoraConfig:
    # Off by default: full fine-tuning. On: the base model is frozen (held in the trainer's compute dtype), only the
    # adapters train (float32, AdamW), a weight push sends only them, checkpoints hold only them.
    enabled: bool = False
    rank: int = 16  # r; "LoRA Without Regret" found rank 1 enough for RL
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input; 0: none (and the engine samples the trained function exactly)

    def __post_init__(self) -> None:
        if self.rank < 1 or not self.alpha > 0:
            raise ValueError(f"lora.rank must be >= 1 and lora.alpha > 0, got rank {self.rank}, alpha {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")


def peft_config(config: LoraConfig, base: str | None = None):
    """peft's `LoraConfig` for these settings (`base`: the base model's name, recorded in saved adapters)."""
    import peft

    return peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=TARGET,
                           bias="none", base_model_name_or_path=base)


def attach(model: nn.Module, config: LoraConfig) -> nn.Module:
    """Attach a fresh adapter (B = 0: the model computes what it did) to every linear layer of `model`'s blocks, in
    place; the model. peft freezes every other parameter (requires_grad False) and makes the adapter in the dtype of
    the layer it adapts."""
    from peft import inject_adapter_in_model

    return inject_adapter_in_model(peft_config(config), model, adapter_name=ADAPTER)


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is an adapter's tensor."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def adapter_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a state dict, under their names."""
    return {k: v for k, v in state.items() if is_adapter(k)}


def _adapted(model: nn.Module) -> dict[str, nn.Module]:
    """The adapted layers of `model`, by module name."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged(model: nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's state dict (no adapter names) from `full`, a state dict of `model` with its adapter attached
    (the tensors may be gathered copies: `model` supplies only the structure and each layer's α/r): each adapted
    weight is W + (α/r)·B A, computed and returned in float32, like every other tensor. Tied tensors stay one tensor."""
    layers = _adapted(model)
    if not layers:
        raise ValueError("merged: the model has no LoRA adapter attached")
    as_float: dict[int, torch.Tensor] = {}  # by identity: a tied weight is converted once and stays tied

    def f32(t: torch.Tensor) -> torch.Tensor:
        return as_float.setdefault(id(t), t.detach().to(torch.float32))

    out = {k: f32(v) for k, v in full.items() if not is_adapter(k) and ".base_layer." not in k}
    for name, layer in layers.items():
        a, b = full[f"{name}.lora_A.{ADAPTER}.weight"], full[f"{name}.lora_B.{ADAPTER}.weight"]
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * layer.scaling[ADAPTER]
        out[f"{name}.weight"] = f32(full[f"{name}.base_layer.weight"]) + (delta.T if layer.fan_in_fan_out else delta)
        if f"{name}.base_layer.bias" in full:
            out[f"{name}.bias"] = f32(full[f"{name}.base_layer.bias"])
    return out


def peft_files(model: nn.Module, tensors: Mapping[str, torch.Tensor], directory: str | Path) -> None:
    """Write the adapter `tensors` (state-dict names of `model`) to `directory` as peft saves an adapter: its weights
    under peft's file names and its `adapter_config.json`, with the target modules `model`'s adapter has and the
    base model's name."""
    from safetensors.torch import save_file

    directory = Path(directory)
    names = {k: PEFT_PREFIX + k.replace(f".{ADAPTER}.", ".") for k in tensors}
    save_file({names[k]: v.detach().contiguous() for k, v in tensors.items()}, directory / ADAPTER_WEIGHTS,
              metadata={"format": "pt"})
    config = model.peft_config[ADAPTER]  # what `attach` recorded: the resolved target modules
    fields = config.to_dict()
    fields["target_modules"] = sorted(fields["target_modules"])
    fields["base_model_name_or_path"] = getattr(model.config, "name_or_path", None) or None
    (directory / ADAPTER_CONFIG).write_text(json.dumps(fields, indent=2, default=str) + "\n")
