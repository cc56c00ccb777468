"""The weight push's contract between a trainer and an engine: the payload codec and the serve token.

The trainer sends its policy as one safetensors file (bytes), so the same object goes to an engine in this process
or over HTTP to `shipyard serve` (`POST /v1/weights`) — a transport the Ray backend can reuse by shipping the bytes
through its object store. The pushing side (`shipyard.train.sync`) encodes; the engine side (`shipyard.models.server`,
an in-process push) decodes, so the format lives here, below both. Its `__metadata__` holds `version`, `format`
and, for MXFP8, the original shape of each quantized tensor:

- `bf16`: every tensor in bfloat16 (2 bytes per value).
- `mxfp8`: the tensors named in `mx_names` (the matrices the trainer runs in MXFP8) as E4M3 elements + E8M0 block
  scales (`<name>.mx_elements`, `<name>.mx_scales`, uint8; `shipyard.models.mxformat`), everything else (norms,
  biases) bf16. 8.25 bits per quantized value.

Tied weights (a head sharing the embedding's tensor) are sent once; `aliases` in the metadata names the others.
`decode` checks a payload's structure completely (it may come from the network) and raises `PayloadError` naming
what is wrong; the engine refuses non-finite values — both before any weight changes. MXFP8 tensors are
dequantized with `shipyard.models.mxformat.dequantize`, the function the trainer's forward uses, so the sampler runs
on bit-identical weights (no post-training quantization).

The serve token: `shipyard serve` guards `/v1/weights` with a bearer token, given in $SHIPYARD_SERVE_TOKEN (or the
file named by $SHIPYARD_SERVE_TOKEN_FILE) or generated at start and written to `token_path(port)`, where a pusher on
the same machine finds it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Literal

import httpx
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from shipyard.httpguard import bearer, loopback_port, read_token
from shipyard.models.mxformat import BLOCK, MXTensor, dequantize, quantize

Format = Literal["bf16", "mxfp8"]
TOKEN_ENV = "SHIPYARD_SERVE_TOKEN"  # the weights token; or a file named by $SHIPYARD_SERVE_TOKEN_FILE


def token_path(port: int) -> Path:
    """Where `shipyard serve --port PORT` writes the token it generated (0600), and where pushers look for it."""
    from shipyard.models.bundled import shipyard_home

    return shipyard_home() / "serve" / f"{port}.token"


def encode(tensors: dict[str, torch.Tensor], version: int, fmt: Format = "bf16",
           mx_names: set[str] | None = None) -> bytes:
    """The payload of `tensors` at `version`: the tensors of `mx_names` (2-D or more) in MXFP8 when `fmt` is mxfp8,
    every other one in bf16."""
    if fmt not in ("bf16", "mxfp8"):
        raise ValueError(f"unknown payload format {fmt!r}: bf16 or mxfp8")
    out: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in tensors.items():
        if t.data_ptr() in first:  # a tied weight: sent once
            aliases[name] = first[t.data_ptr()]
            continue
        first[t.data_ptr()] = name
        if fmt == "mxfp8" and name in (mx_names or set()) and t.ndim >= 2:
            mx = quantize(t)
            out[f"{name}.mx_elements"] = mx.elements.view(torch.uint8).contiguous()
            out[f"{name}.mx_scales"] = mx.scales.view(torch.uint8).contiguous()
            shapes[name] = list(mx.shape)
        else:
            out[name] = t.detach().to("cpu", torch.bfloat16).contiguous()
    meta = {"version": str(version), "format": fmt, "mx_shapes": json.dumps(shapes), "aliases": json.dumps(aliases)}
    return st_save(out, metadata=meta)


def metadata(payload: bytes) -> dict[str, str]:
    (size,) = struct.unpack("<Q", payload[:8])
    return json.loads(payload[8:8 + size]).get("__metadata__", {})


class PayloadError(ValueError):
    """A weight payload that is not what `encode` produces; the message says what is wrong with it."""


def decode(payload: bytes, dtype: torch.dtype = torch.bfloat16) -> tuple[int, dict[str, torch.Tensor]]:
    """(version, tensors in `dtype`) from a payload; MXFP8 tensors dequantized exactly as the trainer does.

    The payload may come from the network: its structure is checked completely (version, dtypes, MXFP8 part shapes,
    aliases) and anything else raises `PayloadError` naming the tensor. Values are not checked here: the engine's
    `update_weights` refuses non-finite values before it changes anything."""
    try:
        meta = metadata(payload)
        raw = st_load(payload)
        version, shapes = int(meta["version"]), json.loads(meta.get("mx_shapes", "{}"))
        aliases = json.loads(meta.get("aliases", "{}"))
    except Exception as e:  # a truncated or foreign body: say what it should be
        raise PayloadError(f"not a shipyard weight payload ({type(e).__name__}: {e}); send the bytes "
                           "shipyard.models.payload.encode produces") from e
    if not 0 <= version <= 2**63 - 1:
        raise PayloadError(f"payload version {version} is not in [0, 2**63 - 1]")
    if not isinstance(shapes, dict) or not isinstance(aliases, dict):
        raise PayloadError("payload metadata: mx_shapes and aliases must be JSON objects")
    tensors = {}
    for name, t in raw.items():
        if name.endswith((".mx_elements", ".mx_scales")):
            if name.rsplit(".", 1)[0] not in shapes:
                raise PayloadError(f"payload tensor {name} is an MXFP8 part without an entry in mx_shapes")
            continue
        if not t.is_floating_point():
            raise PayloadError(f"payload tensor {name} has dtype {t.dtype}; plain tensors must be floating point "
                               "(encode writes bfloat16)")
        tensors[name] = t.to(dtype)
    for name, shape in shapes.items():
        tensors[name] = dequantize(_mx_parts(raw, name, shape), dtype)
    for alias, name in aliases.items():
        if not isinstance(name, str) or name not in tensors:
            raise PayloadError(f"payload alias {alias} names {name!r}, which the payload does not hold")
        tensors[alias] = tensors[name]
    return version, tensors


def _mx_parts(raw: dict[str, torch.Tensor], name: str, shape: object) -> MXTensor:
    """The checked MXFP8 parts of tensor `name` (the shapes `quantize` gives for `shape`)."""
    if not (isinstance(shape, list) and shape and all(isinstance(d, int) and 0 < d < 2**40 for d in shape)):
        raise PayloadError(f"payload mx_shapes[{name}] = {shape!r} is not a shape")
    width = -(-shape[-1] // BLOCK) * BLOCK
    want = {"mx_elements": (*shape[:-1], width), "mx_scales": (*shape[:-1], width // BLOCK)}
    parts = {}
    for part, part_shape in want.items():
        t = raw.get(f"{name}.{part}")
        if t is None or t.dtype != torch.uint8 or tuple(t.shape) != part_shape:
            got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise PayloadError(f"payload tensor {name}.{part} is {got}; for shape {tuple(shape)} it must be uint8 "
                               f"{part_shape}")
        parts[part] = t
    return MXTensor(parts["mx_elements"].view(torch.float8_e4m3fn), parts["mx_scales"].view(torch.float8_e8m0fnu),
                    tuple(shape))


def push_http(base_url: str, payload: bytes, timeout: float = 600, token: str | None = None) -> dict:
    """POST a payload to `shipyard serve` (`BASE_URL/v1/weights`); the server's reply. The bearer token is `token`,
    else $SHIPYARD_SERVE_TOKEN, else the file $SHIPYARD_SERVE_TOKEN_FILE, else — for a server on this machine — the
    file `shipyard serve --port PORT` wrote ($SHIPYARD_HOME/serve/PORT.token)."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/weights"
    port = loopback_port(url)  # the token file of a server on this machine, never sent to another host
    if token is None:
        token = read_token(TOKEN_ENV, token_path(port) if port is not None else None)
    headers = {"content-type": "application/octet-stream", **bearer(token)}
    try:
        r = httpx.post(url, content=payload, timeout=timeout, headers=headers)
    except httpx.HTTPError as e:
        raise ConnectionError(f"could not push weights to {url}: {e}; is `shipyard serve` running there?") from e
    if r.status_code == 401:
        raise RuntimeError(f"{url} refused the weights (401): the token is {'wrong' if token else 'missing'}; pass the "
                           f"one `shipyard serve` wrote to its token file, in ${TOKEN_ENV} or ${TOKEN_ENV}_FILE")
    if r.status_code != 200:
        raise RuntimeError(f"{url} refused the weights ({r.status_code}): {error_message(r)}")
    return r.json()


def error_message(r: httpx.Response) -> str:
    """The message of an OpenAI-style error body (`{"error": {"message": ...}}`), else the start of the body."""
    try:
        return str(r.json()["error"]["message"])[:1000]
    except (ValueError, KeyError, TypeError):
        return r.text[:500]
