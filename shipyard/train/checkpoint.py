"""Checkpoints: weights as safetensors, plus everything needed to continue bit-identically.

Layout of `DIR/step-00000042/`:

    model.safetensors     the full (unsharded) policy weights — what `shipyard serve --model` and exports read
    trainer.json          step, policy version, world size, the training config
    rank{r}-of{N}.pt      this rank's shards: policy, EMA teacher and reference weights, optimizer states (Muon
                          momentum, AdamW moments and step counts), LR schedulers, RNG states (torch, Python)

Every rank writes its own file (no gather of optimizer state), rank 0 the shared ones; the directory appears under
its final name only when complete (written as `.partial`, renamed after a barrier), so a crash mid-save never
leaves a checkpoint that looks whole. Resuming needs the same world size (the shards are per rank); the weights in
model.safetensors load at any world size.

Resuming restores every tensor the next step reads, so training continues bit-identically (tested).
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from shipyard.train.trainer import Trainer


def _modules(trainer: Trainer) -> dict[str, torch.nn.Module]:
    mods = {"model": trainer.model}
    if trainer.ema is not None:
        mods["ema"] = trainer.ema
    if trainer.reference is not None:
        mods["reference"] = trainer.reference
    return mods


def _local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in module.state_dict().items()}


def _optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict with DTensor states as local tensors, and which ones were DTensors."""
    sd = opt.state_dict()  # its per-parameter dicts are the live state: build new ones
    dtensors = []
    states = {}
    for index, state in sd["state"].items():
        states[index] = {}
        for key, value in state.items():
            if isinstance(value, DTensor):
                value = value.to_local()
                dtensors.append((index, key))
            states[index][key] = value.clone() if isinstance(value, torch.Tensor) else value
    return {"state_dict": {**sd, "state": states}, "dtensors": dtensors}


def _untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied weights (the output head sharing the embedding) stored once, under the first name, as transformers
    expects for `tie_word_embeddings` models."""
    out, seen = {}, set()
    for k, v in tensors.items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            out[k] = v.contiguous()
    return out


def save_checkpoint(trainer: Trainer, directory: str | Path, extra: Mapping[str, str] | None = None) -> Path:
    """Write a checkpoint of `trainer` (collective: every rank calls it); its directory. `extra`: more files (name →
    text, written by rank 0) that belong to the same step — the RL loop's scheduler state — so they appear with the
    checkpoint or not at all."""
    for name in extra or {}:  # checked on every rank before any collective, so a bad name fails everywhere alike
        if Path(name).name != name or name in ("trainer.json", "model.safetensors") or name.startswith("rank"):
            raise ValueError(f"extra checkpoint file {name!r}: a plain file name that is not one of the trainer's")
    final = Path(directory) / f"step-{trainer.step_count:08d}"
    partial = final.with_name(final.name + ".partial")
    full = trainer.full_state_dict()  # collective
    if trainer.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    rank_state = {
        "modules": {name: _local_state(m) for name, m in _modules(trainer).items()},
        "optimizers": [_optimizer_state(o) for o in trainer.optimizers],
        "schedulers": [s.state_dict() for s in trainer.schedulers],
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "version": trainer.version, "step": trainer.step_count,
    }
    torch.save(rank_state, partial / f"rank{trainer.rank}-of{trainer.world}.pt")
    if trainer.rank == 0:
        save_file(_untied(full), partial / "model.safetensors",
                  metadata={"version": str(trainer.version), "step": str(trainer.step_count)})
        (partial / "trainer.json").write_text(json.dumps({
            "step": trainer.step_count, "version": trainer.version, "world_size": trainer.world,
            "config": asdict(trainer.config)}, indent=2, default=str) + "\n")
        for name, text in (extra or {}).items():
            (partial / name).write_text(text)
    dist.barrier()
    if trainer.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    dist.barrier()
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under `directory`, or None."""
    done = sorted(p for p in Path(directory).glob("step-*") if p.is_dir() and not p.name.endswith(".partial"))
    return done[-1] if done else None


def load_checkpoint(trainer: Trainer, path: str | Path) -> None:
    """Restore `trainer` (built with the same config and world size) from a checkpoint directory."""
    path = Path(path)
    meta = json.loads((path / "trainer.json").read_text()) if (path / "trainer.json").exists() else None
    if meta is None:
        raise FileNotFoundError(f"{path} is not a shipyard checkpoint (no trainer.json); pick a step-* directory")
    if meta["world_size"] != trainer.world:
        raise ValueError(f"{path} was written by {meta['world_size']} ranks; resume it with the same world size "
                         f"(this run has {trainer.world}), or start from its model.safetensors")
    state = torch.load(path / f"rank{trainer.rank}-of{trainer.world}.pt", weights_only=False)
    modules = _modules(trainer)
    if set(state["modules"]) != set(modules):
        raise ValueError(f"{path} holds {sorted(state['modules'])} but this trainer has {sorted(modules)}: the "
                         "distillation teacher or KL reference settings differ from the checkpointed run's")
    with torch.no_grad():
        for name, module in modules.items():
            saved = state["modules"][name]
            for key, value in module.state_dict().items():
                (value.to_local() if isinstance(value, DTensor) else value).copy_(saved[key])
    for opt, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(saved["state_dict"])
        params = [p for group in opt.param_groups for p in group["params"]]
        for index, key in saved["dtensors"]:
            p = params[index]
            local = opt.state[p][key]
            opt.state[p][key] = DTensor.from_local(local.to(p.device), p.device_mesh, p.placements,
                                                   shape=p.shape, stride=p.stride())
    for sched, saved in zip(trainer.schedulers, state["schedulers"], strict=True):
        sched.load_state_dict(saved)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    trainer.version, trainer.step_count = state["version"], state["step"]
