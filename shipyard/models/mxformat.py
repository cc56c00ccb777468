"""MXFP8 (OCP Microscaling Formats v1.0): 8-bit elements sharing one power-of-two scale per block of 32.

A tensor is cut into blocks of K = 32 consecutive values along its last dimension (the reduction dimension of a
linear layer's weight and input). Each block stores one E8M0 scale — an 8-bit biased exponent, X = 2^(e − 127),
e = 255 meaning NaN — and 32 FP8 E4M3 elements (1 sign, 4 exponent, 3 mantissa bits, max normal 448). A value is
v ≈ X · P with P the element. Cost: 8 bits per element + 8 bits per 32 = 8.25 bits, 0.516× bf16.

Scale choice, rounded **up** (the RCEIL recipe of NVIDIA's cuBLAS block scaling and torchao): the smallest power of
two with amax / X ≤ 448, i.e. X = 2^⌈log2(amax / 448)⌉, so no element saturates — where the OCP spec's
floor(log2 amax) − 8 can push the block maximum past 448 and clamp it. Exponents clamp to [−127, 127]; an all-zero
block gets X = 2^−127. Elements are round-to-nearest-even casts of v / X to E4M3.

The format lives with the engines because both sides of the weight push use it: the trainer's MXFP8 layers
(`shipyard.train.mx`) compute with dequantize(quantize(·)), its payloads carry `quantize`'s parts
(`shipyard.models.payload`), and the engine that loads them calls `dequantize` here — the function the trainer's
forward used, so the sampler runs on exactly the trainer's weights: no post-training quantization step, no drift.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127


@dataclass
class MXTensor:
    """An MXFP8 tensor: `elements` (float8_e4m3fn, shape padded to a multiple of 32 on the last dim), `scales`
    (float8_e8m0fnu, one per block), and the original shape."""

    elements: Tensor
    scales: Tensor
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.elements.numel() + self.scales.numel()


def _ceil_log2(x: Tensor) -> Tensor:
    """⌈log2 x⌉ exactly, for positive finite float32 x (frexp: x = m·2^e, m ∈ [0.5, 1))."""
    mantissa, exponent = torch.frexp(x)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def quantize(x: Tensor, block: int = BLOCK) -> MXTensor:
    """MXFP8 of `x` blocked along its last dimension (zero-padded to a multiple of `block`)."""
    shape = tuple(x.shape)
    v = x.detach().float()
    pad = (-shape[-1]) % block
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // block, block)
    amax = blocks.abs().amax(-1)
    exp = _ceil_log2((amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny))
    # Division rounding can leave amax / 2^exp a hair above 448: then the next power of two.
    exp = torch.where(amax / torch.exp2(exp.float()) > E4M3_MAX, exp + 1, exp)
    exp = torch.where(amax == 0, -E8M0_BIAS, exp).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = (blocks / torch.exp2(exp.float())[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    biased = torch.where(torch.isnan(amax), 255, exp + E8M0_BIAS).to(torch.uint8)
    elements = scaled.to(torch.float8_e4m3fn).reshape(v.shape)
    return MXTensor(elements, biased.view(torch.float8_e8m0fnu), shape)


def dequantize(mx: MXTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values an MXFP8 tensor stands for, in `dtype`, with its original shape."""
    e = mx.elements.float()
    blocks = e.reshape(*e.shape[:-1], -1, BLOCK)
    exp = mx.scales.view(torch.uint8).int() - E8M0_BIAS
    scale = torch.where(exp == 255 - E8M0_BIAS, torch.nan, torch.exp2(exp.float()))
    out = (blocks * scale[..., None]).reshape(e.shape)[..., :mx.shape[-1]]
    return out.to(dtype).reshape(mx.shape)
