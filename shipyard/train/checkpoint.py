"""Checkpoints: weights as safetensors, plus everything needed to continue — bit-identically on the same number of
ranks, and on any other number.

Layout of `DIR/step-00000042/`:

    model.safetensors     the full (unsharded) policy weights — what `shipyard serve --model` and exports read
    adapter_model.safetensors, adapter_config.json
                          instead, with LoRA: the adapter alone, as peft saves one (`PeftModel.from_pretrained(base,
                          DIR)` and vLLM's LoRA loading read it); the frozen base is the run's `model.name`
    trainer.json          step, policy version, world size, which modules are saved, the training config
    dcp/                  torch.distributed.checkpoint: the policy, EMA teacher and reference weights and the optimizer
                          states (Muon momentum, AdamW moments and step counts), each rank writing its own shards
    trainer.pt            rank 0: the LR schedulers, the Python RNG
    rng-rank{r}.pt        rank r's torch RNG state

**Resharding.** The weights and optimizer states go through `torch.distributed.checkpoint` (DCP) with the
`get_state_dict`/`set_state_dict` API, which names every tensor by its parameter's fully qualified name and records
each shard's offsets in the checkpoint's metadata. Loading asks for the tensors in the layout of the trainer being
restored — plain tensors on one rank, FSDP2 `Shard(0)` DTensors on N — and DCP reads the byte ranges each rank
needs, so a checkpoint written by N ranks loads on M (tests: 2 → 1, 1 → 2, 2 → 2 bitwise). Nothing is gathered or
copied to save: the live tensors are written. The RNG rule across world sizes: rank r restores rank r's torch RNG
if the writing run had one, else keeps its own seeded state (the trainer's sampling does not use it; the RL loop's
randomness is in the scheduler's state).

**LoRA.** The frozen base is not saved: dcp/ holds the adapters (the policy's, the EMA teacher's, the reference's)
and their AdamW state, a few MB, and resuming reloads the base from the model it came from. A checkpoint is loaded
only by a trainer with the same `[trainer.lora]` (on, rank, alpha), or the same absence of it.

Every rank writes its own shards, rank 0 the shared files; the directory appears under its final name only when
complete (written as `.partial`, renamed after a barrier), so a crash mid-save never leaves a checkpoint that looks
whole.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from shipyard.errors import InputNotFound, UsageError
from shipyard.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_tensors, peft_files
from shipyard.train.trainer import Trainer

WEIGHTS = "model.safetensors"


def _modules(trainer: Trainer) -> dict[str, torch.nn.Module]:
    mods = {"model": trainer.model}
    if trainer.ema is not None:
        mods["ema"] = trainer.ema
    if trainer.reference is not None:
        mods["reference"] = trainer.reference
    return mods


def _state(trainer: Trainer) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """What DCP saves and loads: the trainer's modules and optimizers, by fully qualified names, in this trainer's
    layout (collective: every rank calls it); and the optimizer states presented as DTensors here.

    Muon keeps a sharded parameter's momentum as the plain local block (its Newton–Schulz runs on whole matrices it
    gathers itself), which DCP would take for a replicated tensor of the block's shape; such a state is presented
    as a DTensor with its parameter's placements — a view of the same memory — so it reshards like the parameter."""
    model, optim = get_state_dict(trainer.model, trainer.optimizers)
    params = dict(trainer.model.named_parameters())
    kept = adapter_tensors if trainer.config.lora.enabled else dict  # LoRA: the frozen base is not saved
    wrapped = []
    for fqn, entry in optim["state"].items():
        p = params.get(fqn)
        if not isinstance(p, DTensor):
            continue
        entry = dict(entry)  # may be the optimizer's own dict: never change it
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0 \
                    and value.shape == p.to_local().shape:
                entry[key] = DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                wrapped.append((fqn, key))
        optim["state"][fqn] = entry
    state = {"model": kept(model), "optim": optim}
    for name, module in _modules(trainer).items():
        if name != "model":
            state[name] = kept(get_model_state_dict(module))
    return state, wrapped


def _untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied weights (the output head sharing the embedding) stored once, under the first name, as transformers
    expects for `tie_word_embeddings` models."""
    out, seen = {}, set()
    for k, v in tensors.items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            out[k] = v.contiguous()
    return out


def free_bytes(path: Path) -> int:
    """Bytes free for this user on the file system that holds `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _nbytes(tree: Any) -> int:
    """Bytes of the tensors in a state dict (nested dicts and lists; a DTensor counts its local shard)."""
    if isinstance(tree, DTensor):
        return tree.to_local().nbytes
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    if isinstance(tree, Mapping):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_nbytes(v) for v in tree)
    return 0


class CheckpointSpaceError(UsageError, OSError):
    """A checkpoint that would not fit on its disk, refused before anything is written."""


def _check_space(trainer: Trainer, final: Path, local_bytes: int, keep: int) -> None:
    """Refuse, on every rank alike, a checkpoint whose tensors (every rank's, summed) exceed the free space where it
    goes: a full disk otherwise fails deep inside `torch.save` ("unexpected pos 704 vs 598") after minutes of
    writing, with the run's last good checkpoint as its only hint."""
    need = torch.tensor([local_bytes], dtype=torch.float64)
    dist.all_reduce(need)
    need += need * 0.05 + (64 << 20)  # DCP's metadata, the pickled RNG and scheduler states: ~10 % on a tiny model
    try:
        free = free_bytes(final.parent)
    except OSError:  # reported through the collective below, never raised on one rank while the others wait
        free = 0
    short = torch.tensor([1.0 if need.item() > free else 0.0], dtype=torch.float64)
    dist.all_reduce(short, op=dist.ReduceOp.MAX)
    if short.item():
        raise CheckpointSpaceError(
            f"the checkpoint of step {trainer.step_count} needs ~{_size(need.item())} in {final.parent}, which "
            f"has {_size(free)} free (the newest [run] keep_checkpoints = {keep or 'all'} are kept, and one "
            "more is written before the oldest goes): free space there, keep fewer (keep_checkpoints = 1), or "
            "checkpoint less often ([run] checkpoint_every)")


def require_space(directory: Path, need: float, what: str) -> None:
    """Refuse to write `what` (`need` bytes) into `directory` when its file system has less free: before anything is
    written, with what to do. One process (an export is rank 0's); a checkpoint's collective check is `_check_space`."""
    free = free_bytes(directory)
    if need > free:
        raise CheckpointSpaceError(f"{what} needs ~{_size(need)} in {directory}, which has {_size(free)} free: free "
                                   "space there, or give the run a directory on a larger disk ([run] dir)")


def _size(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def save_checkpoint(trainer: Trainer, directory: str | Path, extra: Mapping[str, str] | None = None,
                    keep: int = 0) -> Path:
    """Write a checkpoint of `trainer` (collective: every rank calls it); its directory. `extra`: more files (name →
    text, written by rank 0) that belong to the same step — the RL loop's scheduler state — so they appear with the
    checkpoint or not at all. With `keep` > 0, only the newest `keep` checkpoints under `directory` remain once this
    one is complete (`prune`)."""
    for name in extra or {}:  # checked on every rank before any collective, so a bad name fails everywhere alike
        if Path(name).name != name or name in ("trainer.json", WEIGHTS, ADAPTER_WEIGHTS, ADAPTER_CONFIG) \
                or name.startswith("rank"):
            raise ValueError(f"extra checkpoint file {name!r}: a plain file name that is not one of the trainer's")
    final = Path(directory) / f"step-{trainer.step_count:08d}"
    partial = final.with_name(final.name + ".partial")
    lora = trainer.config.lora.enabled
    full = trainer.engine_weights()  # collective; with LoRA the adapter's tensors only
    state = _state(trainer)[0]
    if trainer.rank == 0:  # a save that died here before (a full disk) left its files: they are not in the way
        shutil.rmtree(partial, ignore_errors=True)
    _check_space(trainer, final, _nbytes(state) + (_nbytes(full) if trainer.rank == 0 else 0), keep)
    if trainer.rank == 0:
        partial.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=partial / "dcp")
    torch.save(torch.get_rng_state(), partial / f"rng-rank{trainer.rank}.pt")
    if trainer.rank == 0:
        if lora:
            peft_files(trainer.model, full, partial)
        else:
            save_file(_untied(full), partial / WEIGHTS,
                      metadata={"version": str(trainer.version), "step": str(trainer.step_count)})
        torch.save({"schedulers": [s.state_dict() for s in trainer.schedulers], "python_rng": random.getstate()},
                   partial / "trainer.pt")
        (partial / "trainer.json").write_text(json.dumps({
            "step": trainer.step_count, "version": trainer.version, "world_size": trainer.world,
            "modules": sorted(_modules(trainer)), "config": asdict(trainer.config)}, indent=2, default=str) + "\n")
        for name, text in (extra or {}).items():
            (partial / name).write_text(text)
    dist.barrier()
    if trainer.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        if keep:
            prune(directory, keep)
    dist.barrier()
    return final


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints under `directory` (and any unfinished one older than
    the newest complete one: a save that crashed); what was deleted. Only `step-N` directories are touched."""
    steps = _checkpoints(directory, partial=True)
    done = [p for p in steps if not p.name.endswith(".partial")]
    if not done:
        return []
    gone = done[:-keep] + [p for p in steps if p.name.endswith(".partial") and p.name < done[-1].name]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def _lora(settings: dict | None) -> dict:
    """What must match between a checkpoint's LoRA settings and a trainer's: none when off (or never set)."""
    return {k: settings[k] for k in ("rank", "alpha")} if settings and settings.get("enabled") else {}


STEP = re.compile(r"step-\d{8}(\.partial)?")


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under `directory` (a `step-N` directory: another name there is not one), or
    None."""
    done = _checkpoints(directory)
    return done[-1] if done else None


def _checkpoints(directory: str | Path, partial: bool = False) -> list[Path]:
    """The complete checkpoints under `directory`, oldest first (with `partial`, unfinished ones among them)."""
    found = sorted(p for p in Path(directory).glob("step-*") if p.is_dir() and STEP.fullmatch(p.name))
    return [p for p in found if partial or not p.name.endswith(".partial")]


def load_checkpoint(trainer: Trainer, path: str | Path) -> None:
    """Restore `trainer` (built with the same config, on any number of ranks) from a checkpoint directory
    (collective)."""
    path = Path(path)
    meta = json.loads((path / "trainer.json").read_text()) if (path / "trainer.json").exists() else None
    if meta is None:
        raise InputNotFound(f"{path} is not a shipyard checkpoint (no trainer.json); pick a step-* directory")
    if not (path / "dcp" / ".metadata").exists():
        raise InputNotFound(f"{path} has no dcp/ shards (written by an older shipyard, or incomplete): start "
                                "from its model.safetensors")
    modules = sorted(_modules(trainer))
    if meta.get("modules") != modules:
        raise UsageError(f"{path} holds {meta.get('modules')} but this trainer has {modules}: the distillation "
                         "teacher or KL reference settings differ from the checkpointed run's")
    saved, lora = _lora(meta["config"].get("lora")), _lora(asdict(trainer.config.lora))
    if saved != lora:
        raise UsageError(f"{path} was written with [trainer.lora] {saved or 'off'} but this trainer has "
                         f"{lora or 'off'}: resume with the checkpointed run's LoRA settings")
    state, wrapped = _state(trainer)
    dcp.load(state, checkpoint_id=path / "dcp")
    for fqn, key in wrapped:  # back to the local blocks the optimizer keeps
        state["optim"]["state"][fqn][key] = state["optim"]["state"][fqn][key].to_local()
    options = StateDictOptions(strict=not trainer.config.lora.enabled)  # LoRA: the base is not in the checkpoint
    set_state_dict(trainer.model, trainer.optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    for name, module in _modules(trainer).items():
        if name != "model":
            set_model_state_dict(module, state[name], options=options)
    shared = torch.load(path / "trainer.pt", weights_only=False)
    for sched, saved in zip(trainer.schedulers, shared["schedulers"], strict=True):
        sched.load_state_dict(saved)
    random.setstate(shared["python_rng"])
    rng = path / f"rng-rank{trainer.rank}.pt"
    if rng.exists():  # a rank the writing run did not have keeps its own seeded state (module docstring)
        torch.set_rng_state(torch.load(rng))
    trainer.version, trainer.step_count = meta["version"], meta["step"]
    trainer.weights_changed()
