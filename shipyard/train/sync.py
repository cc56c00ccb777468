"""Weight sync: versioned pushes of the policy to inference engines, as bf16 or MXFP8 payloads.

The payload — one safetensors file, its format and checks — is `shipyard.models.payload`, shared with the engines
that load it. This module is the pushing side: which weights go as MXFP8 (`mx_weight_names`), and the push itself,
to an engine in this process (`push_to_engine`) or over HTTP to `shipyard serve` (`POST /v1/weights`, `push_http`).
In MXFP8 the payload carries the matrices the trainer runs in MXFP8 (its `MXLinear` and `MXEmbedding` layers: by
default every linear layer, the head and the embeddings), and the engine dequantizes them with the function the
trainer's forward uses, so the sampler runs on bit-identical weights.

A payload is a whole model: `shipyard serve` loads one only if it covers every weight of the served model (aliases
included; 400 naming the missing tensors otherwise) and its version is above the served one (409 otherwise), so push
`model.state_dict()` (or `Trainer.full_state_dict()`) with increasing versions.

Each push returns its `SyncStats` (bytes, seconds for encode, transfer and load), which the trainer logs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from shipyard.models.engine import Engine
from shipyard.models.payload import Format, decode, encode, push_http
from shipyard.train.mx import MXEmbedding, MXLinear


@dataclass
class SyncStats:
    version: int
    format: str
    bytes: int
    tensors: int
    encode_seconds: float
    push_seconds: float  # transfer + load on the engine side

    @property
    def seconds(self) -> float:
        return self.encode_seconds + self.push_seconds


def mx_weight_names(model: nn.Module, skip: tuple[str, ...] = ()) -> set[str]:
    """State-dict names of the weights a payload quantizes: those of the MXFP8 layers, or — for a model not trained
    in MXFP8 — of its linear and embedding layers but `skip` (then MXFP8 sync is post-training quantization)."""
    mx = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, MXLinear | MXEmbedding)}
    return mx or {f"{n}.weight" for n, m in model.named_modules()
                  if isinstance(m, nn.Linear | nn.Embedding) and not any(s in n for s in skip)}


def push_to_engine(engine: Engine, payload: bytes, dtype: torch.dtype = torch.bfloat16) -> int:
    """Load a payload into an engine in this process; the version it now serves."""
    version, tensors = decode(payload, dtype)
    engine.update_weights(version, tensors)
    return version


def sync(tensors: dict[str, torch.Tensor], version: int, *, fmt: Format = "bf16", mx_names: set[str] | None = None,
         engine: Engine | None = None, url: str | None = None, token: str | None = None) -> SyncStats:
    """Encode once and push to an in-process engine or a server; bytes and seconds recorded."""
    if (engine is None) == (url is None):
        raise ValueError("push to exactly one target: an engine in this process or a server url")
    t0 = time.perf_counter()
    payload = encode(tensors, version, fmt, mx_names)
    t1 = time.perf_counter()
    if engine is not None:
        push_to_engine(engine, payload)
    else:
        push_http(url, payload, token=token)
    return SyncStats(version, fmt, len(payload), len(tensors), t1 - t0, time.perf_counter() - t1)
