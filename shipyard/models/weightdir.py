"""Versioned checkpoints that inference servers read: the filesystem half of a weight push to vLLM.

vLLM reloads weights from a directory of safetensors files (`reload_weights`, `shipyard.models.vllm`). It is not
all-or-nothing: tried on vLLM 0.32 (CPU), a file holding 3 of a model's 26 tensors was loaded as it was (the served
model became a mix of two versions) and a tensor of the wrong shape killed the engine process. So everything is
checked here, against the served checkpoint's own manifest (`manifest`: names, shapes and dtypes read from its
safetensors headers, no tensor loaded), before a file is written:

- the push names exactly the manifest's tensors (a tied head may come as a second name of the embedding's tensor,
  and is dropped when the checkpoint does not store it);
- every shape is the manifest's; every value finite (a NaN served is a run silently gone);
- tensors are written in the manifest's dtype (bf16 for the bundled models).

A tied head is a second name of the embedding only when it *is* that tensor (the same memory, viewed the same way):
a view that starts where the embedding starts, or an empty tensor (every one has address 0), is an unknown name.

**Adapters** (`[trainer.lora]`: a push carries the LoRA adapter alone, `shipyard.models.lora`). `checked_adapter`
holds an adapter to the same standard, against the base checkpoint it adapts: every name is `<layer>.lora_A.default.
weight` or `.lora_B.` of a 2-D `<layer>.weight` of the manifest; A is (rank, in) and B (out, rank) for that layer's
(out, in) and the configured rank; every adapted layer has both; values finite; and every push names the same
tensors as the first (vLLM replaces an adapter whole). The version is written as peft saves an adapter
(`adapter_model.safetensors` in the base's dtype, `adapter_config.json`), which vLLM's `/v1/load_lora_adapter` reads.

`WeightDir.write(version, tensors)` writes `ROOT/v{version}/model.safetensors` through a temporary directory and a
rename, so a server never reads a half-written file; writing a version already there returns its path (several
servers behind one router read one copy), and older versions — and partial ones a killed run left — are removed once
a newer one is complete. `ROOT` is private (mode 0700) and refused when others can write it: whoever can write it
can swap a version's directory for weights of their own between its write and the server's read. A push to
servers on other machines needs `ROOT` on a filesystem they share (prime-rl's filesystem push works the same way).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from shipyard.errors import FileFormatError, InputNotFound, UserError
from shipyard.models.engine import VersionConflict
from shipyard.models.lora import ADAPTER, ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, LoraConfig, peft_config

VERSION_DIR = re.compile(r"v\d+|\.v\d+\.partial")  # the directories a WeightDir writes (and removes)
MAX_HEADER = 100 << 20  # bytes of one safetensors header; real ones are kilobytes
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class UnsafeWeightsRoot(UserError, PermissionError):
    """A weights directory that another user could write (module docstring)."""


class PushRejected(ValueError):
    """A weight push that does not fit the served checkpoint (names, shapes, dtypes, values): nothing was written
    and the servers keep their weights. The message names what is wrong."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


def manifest(model_dir: Path) -> dict[str, TensorSpec]:
    """Name → shape and dtype of every tensor stored in the checkpoint `model_dir` (its *.safetensors headers)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise InputNotFound(f"{model_dir} holds no *.safetensors file: a server's model must be a directory of "
                            "safetensors weights for pushes to be checked against it")
    out: dict[str, TensorSpec] = {}
    for path in files:
        for name, entry in _header(path).items():
            if name == "__metadata__":
                continue
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not (isinstance(shape, list) and isinstance(entry.get("dtype"), str)
                    and all(type(d) is int and d >= 0 for d in shape)):
                raise FileFormatError(f"{path}: entry {name!r} of its header is not a safetensors header's "
                                      "(dtype, shape); is this a safetensors file?")
            if entry["dtype"] not in _DTYPES:
                raise FileFormatError(f"{path}: tensor {name} is stored as {entry['dtype']}; pushes write only "
                                      f"{', '.join(_DTYPES)} checkpoints")
            out[name] = TensorSpec(tuple(entry["shape"]), _DTYPES[entry["dtype"]])
    return out


def _header(path: Path) -> dict:
    """The JSON header of the safetensors file `path` (its first 8 bytes are the header's length)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FileFormatError(f"{path}: {len(head)} bytes, shorter than a safetensors header's length; is this a "
                                  "safetensors file?")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER:
            raise FileFormatError(f"{path}: a safetensors header of {size} bytes; is this a safetensors file?")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise FileFormatError(f"{path}: its header is not JSON ({e}); is the file whole?") from e
    if not isinstance(header, dict):
        raise FileFormatError(f"{path}: its header is not a safetensors header (a JSON object of tensors)")
    return header


def _same(t: torch.Tensor) -> tuple | None:
    """What two names of one tensor share: the memory and how it is viewed (None for a tensor without memory of its
    own — meta or empty — which is never a second name)."""
    if t.is_meta or t.numel() == 0:
        return None
    return t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride()


def checked(tensors: Mapping[str, torch.Tensor], spec: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """The push as the checkpoint stores it (module docstring): every tensor of `spec`, in its dtype, contiguous on
    the CPU; `PushRejected` naming the first problem otherwise."""
    out: dict[str, torch.Tensor] = {}
    memory: set[int] = set()  # of the tensors in `out`: safetensors refuses to save one memory under two names
    for name, t, want in matched(tensors, spec):
        value = t.detach().to("cpu", want.dtype).contiguous()
        if value.numel() and value.untyped_storage().data_ptr() in memory:
            value = value.clone()
        memory.add(value.untyped_storage().data_ptr())
        finite(name, value)
        out[name] = value
    return out


def matched(tensors: Mapping[str, torch.Tensor], spec: Mapping[str, TensorSpec]
            ) -> list[tuple[str, torch.Tensor, TensorSpec]]:
    """(name, pushed tensor, what the checkpoint stores) for every tensor of `spec`, in its order, once the names and
    shapes are the checkpoint's and every tensor is a floating-point one with values; `PushRejected` otherwise. The
    values are not read (`finite` after the cast)."""
    stored = {_same(tensors[n]) for n in tensors if n in spec} - {None}
    tied = {n for n in tensors if n not in spec and _same(tensors[n]) in stored}  # a tied head's second name
    unknown = sorted(n for n in tensors if n not in spec and n not in tied)
    missing = sorted(n for n in spec if n not in tensors)
    if unknown or missing:
        raise PushRejected(f"the push does not match the served checkpoint: {len(missing)} of its tensors missing "
                           f"{missing[:4]}, {len(unknown)} unknown {unknown[:4]}; push the whole model's state dict "
                           "(Trainer.engine_weights) of the model the servers serve")
    for name, want in spec.items():
        t = tensors[name]
        if tuple(t.shape) != want.shape:
            raise PushRejected(f"pushed tensor {name} has shape {tuple(t.shape)}; the served checkpoint's is "
                               f"{want.shape}")
        if not t.is_floating_point():
            raise PushRejected(f"pushed tensor {name} is {t.dtype}, not a floating-point weight")
        if t.is_meta:
            raise PushRejected(f"pushed tensor {name} is on the meta device: it has no values")
    return [(name, tensors[name], want) for name, want in spec.items()]


def finite(name: str, value: torch.Tensor) -> None:
    if not torch.isfinite(value).all():
        raise PushRejected(f"pushed tensor {name} holds non-finite values (NaN or inf, after the cast to "
                           f"{value.dtype}); the servers keep their weights")


def checked_adapter(tensors: Mapping[str, torch.Tensor], spec: Mapping[str, TensorSpec], lora: LoraConfig,
                    first: set[str] | None) -> dict[str, torch.Tensor]:
    """An adapter push as its files store it (module docstring): peft's names, the base's dtype, contiguous on the
    CPU; `PushRejected` naming the first problem otherwise. `first`: the names of the first push (None: this is it)."""
    if not tensors:
        raise PushRejected("the adapter push holds no tensor")
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, set[str]] = {}
    for name, t in sorted(tensors.items()):
        layer, sep, part = name.rpartition(".lora_")
        base = spec.get(f"{layer}.weight")
        if not sep or part not in (f"A.{ADAPTER}.weight", f"B.{ADAPTER}.weight") or base is None \
                or len(base.shape) != 2:
            raise PushRejected(f"pushed tensor {name} is not a LoRA matrix of a linear layer of the served checkpoint "
                               f"(<layer>.lora_A.{ADAPTER}.weight / lora_B of a 2-D <layer>.weight); push "
                               "Trainer.engine_weights() of a [trainer.lora] trainer of the served model")
        out_features, in_features = base.shape
        want = (lora.rank, in_features) if part[0] == "A" else (out_features, lora.rank)
        if tuple(t.shape) != want or not t.is_floating_point() or t.is_meta:
            raise PushRejected(f"pushed tensor {name} is {tuple(t.shape)} {t.dtype}; rank {lora.rank} over the "
                               f"served layer's {base.shape} needs {want} floating-point values")
        value = t.detach().to("cpu", base.dtype).contiguous().clone()
        finite(name, value)
        layers.setdefault(layer, set()).add(part[0])
        out[PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")] = value
    half = sorted(layer for layer, parts in layers.items() if parts != {"A", "B"})
    if half:
        raise PushRejected(f"the adapter push holds only one of LoRA's two matrices for {half[:4]}")
    if first is not None and set(tensors) != first:
        raise PushRejected(f"the adapter push names {len(tensors)} tensors, not the {len(first)} of the first push "
                           f"(differing: {sorted(set(tensors) ^ first)[:4]}); an adapter is replaced whole")
    return out


def adapter_config(lora: LoraConfig, tensors: Mapping[str, torch.Tensor], base: str) -> dict:
    """peft's `adapter_config.json` for `lora` over the modules `tensors` (peft's names) adapt."""
    fields = peft_config(lora, base).to_dict()
    fields["target_modules"] = sorted({n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in tensors})
    fields["peft_type"], fields["task_type"] = "LORA", None
    return json.loads(json.dumps(fields, default=str))


class WeightDir:
    """The versions written for the servers (module docstring). Thread-safe."""

    def __init__(self, root: Path, spec: Mapping[str, TensorSpec], lora: LoraConfig | None = None, base: str = ""):
        self.root = Path(root)
        self.spec = dict(spec)
        self.lora = lora if lora is not None and lora.enabled else None  # versions are adapters of the checkpoint
        self.base = base  # the checkpoint's name, recorded in adapters' configs
        self.adapter_names: set[str] | None = None
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = self.root.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise UnsafeWeightsRoot(f"{self.root} is writable by other users (or not yours): anyone who can write it "
                                    "can replace the weights the servers load; use a run directory of your own, or "
                                    f"chmod 700 {self.root}")
        self._lock = threading.Lock()
        self.latest: int | None = None
        self.last_bytes = 0
        self.held: tuple[int, dict[str, torch.Tensor]] | None = None  # (version, weights) of an NCCL push: `hold`

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def hold(self, version: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`version` checked as `write` checks it and kept in memory instead of written (an NCCL push,
        `shipyard.models.nccl`): on the CPU, in the checkpoint's dtypes and order — one copy for every server, and
        for a server restarted before the next push. The version before it is released once this one is whole (two
        copies for the length of a check: a rejected push keeps the one the servers hold)."""
        with self._lock:
            if self.held is not None and self.held[0] == version:
                return self.held[1]
            if self.held is not None and version < self.held[0]:
                raise VersionConflict(f"weights version {version} is older than version {self.held[0]}, already "
                                      "pushed to the servers")
            weights = checked(tensors, self.spec)
            self.held = (version, weights)
            self.last_bytes = sum(t.numel() * t.element_size() for t in weights.values())
            return weights

    def kept(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest version `hold` kept, once a hold under way is done (a restarted server is given it)."""
        with self._lock:
            return self.held

    def write(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Path:
        """The directory holding `version` (written now, or already): `PushRejected` before anything is written when
        the push does not fit; `VersionConflict` for a version below the latest written."""
        with self._lock:
            target = self.path(version)
            if self.latest == version and target.is_dir():
                return target
            if self.latest is not None and version < self.latest:
                raise VersionConflict(f"weights version {version} is older than version {self.latest}, already "
                                      "written for the servers")
            if self.lora is None:
                weights, file = checked(tensors, self.spec), "model.safetensors"
            else:
                weights, file = checked_adapter(tensors, self.spec, self.lora, self.adapter_names), ADAPTER_WEIGHTS
            tmp = self.root / f".v{version}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            save_file(weights, str(tmp / file), metadata={"format": "pt", "version": str(version)})
            if self.lora is not None:
                (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(self.lora, weights, self.base), indent=1))
                self.adapter_names = set(tensors)
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
            self.last_bytes = sum(f.stat().st_size for f in target.iterdir())
            for old in self.root.iterdir():  # only what this class writes: v<N>, .v<N>.partial
                if old != target and VERSION_DIR.fullmatch(old.name) and old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old, ignore_errors=True)
            self.latest = version
            return target
