"""MXFP8 (OCP Microscaling Formats v1.0): 8-bit elements sharing one power-of-two scale per block of 32.

A tensor is cut into blocks of K = 32 consecutive values along its last dimension (the reduction dimension of a
linear layer's weight and input). Each block stores one E8M0 scale — an 8-bit biased exponent, X = 2^(e − 127),
e = 255 meaning NaN — and 32 FP8 E4M3 elements (1 sign, 4 exponent, 3 mantissa bits, max normal 448). A value is
v ≈ X · P with P the element. Cost: 8 bits per element + 8 bits per 32 = 8.25 bits, 0.516× bf16.

Scale choice, rounded **up** (the RCEIL recipe of NVIDIA's cuBLAS block scaling and torchao): the smallest power of
two with amax / X ≤ 448, i.e. X = 2^⌈log2(amax / 448)⌉, so no element saturates — where the OCP spec's
floor(log2 amax) − 8 can push the block maximum past 448 and clamp it. Exponents clamp to [−127, 127]; an all-zero
block gets X = 2^−127. Elements are round-to-nearest-even casts of v / X to E4M3.

Training in MXFP8 here is emulation (`MXLinear`, `MXEmbedding`): the forward multiplies dequantize(quantize(·))
of the input and of the weight, both blocked along the reduction dim; the backward quantizes the operands of its
two matmuls blocked along *their* reduction dims (grad_output and weightᵀ along the output features for
grad_input; grad_outputᵀ and inputᵀ along the tokens for grad_weight), as torchao's MX training recipe does.
Embedding tables are stored in MXFP8 too (rows blocked along the hidden dim, straight-through gradient), so a tied
output head and the embedding share one MXFP8 tensor. On Blackwell GPUs torchao's own MXLinear (real MX tensor
cores, linear layers only) is used instead (`convert_to_mxfp8(backend="auto")`).

Because the sampler gets the policy as MXFP8 payloads (`quantize` here) and dequantizes them with `dequantize`
here, it runs on exactly the weights the trainer's forward used: no post-training quantization step, no drift.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

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


def fake_quantize(x: Tensor, dim: int = -1) -> Tensor:
    """dequantize(quantize(x)) with blocks along `dim`, in x's dtype."""
    moved = x.movedim(dim, -1)
    return dequantize(quantize(moved), x.dtype).movedim(-1, dim)


class _MXMatmul(torch.autograd.Function):
    """y = x Wᵀ with every matmul operand fake-quantized along that matmul's reduction dimension."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return fake_quantize(x, -1) @ fake_quantize(weight, -1).T

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = fake_quantize(grad, -1) @ fake_quantize(weight, 0)  # reduce over output features
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_w = fake_quantize(g2, 0).T @ fake_quantize(x2, 0)  # reduce over tokens
        return grad_x, grad_w


class MXLinear(nn.Linear):
    """nn.Linear trained in emulated MXFP8 (see the module docstring); the bias stays in high precision."""

    def forward(self, x: Tensor) -> Tensor:
        y = _MXMatmul.apply(x, self.weight)
        return y + self.bias if self.bias is not None else y


class MXEmbedding(nn.Embedding):
    """An embedding table stored in MXFP8 (blocks along the hidden dim): lookups return dequantized rows, and the
    gradient reaches the high-precision master weight unchanged (straight-through). A head tied to it quantizes
    the same weight along the same dim, so one MXFP8 tensor serves both."""

    def forward(self, ids: Tensor) -> Tensor:
        w = self.weight
        return nn.functional.embedding(ids, w + (fake_quantize(w) - w).detach(), self.padding_idx)


def convert_to_mxfp8(model: nn.Module, skip: tuple[str, ...] = (), backend: str = "auto") -> int:
    """Swap the model's nn.Linear and nn.Embedding layers (except names containing one of `skip`) for MXFP8 ones —
    the output head and the embeddings included by default, so the sampler's payload is MXFP8 almost entirely;
    `skip=("lm_head", "embed")` keeps them in high precision. The count swapped.

    backend "emulated": `MXLinear` (any device); "torchao": torchao's MXFP8 training (Blackwell GPUs);
    "auto": torchao on a CUDA device of compute capability >= 10.0, emulated elsewhere."""
    if backend == "auto":
        cuda = next(model.parameters()).is_cuda
        backend = "torchao" if cuda and torch.cuda.get_device_capability()[0] >= 10 else "emulated"
    if backend == "torchao":
        from torchao.prototype.mx_formats import MXLinearConfig
        from torchao.quantization import quantize_

        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not any(s in n for s in skip)]
        quantize_(model, MXLinearConfig.from_recipe_name("mxfp8_cublas"),
                  filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and not any(s in fqn for s in skip))
        return len(names)
    if backend != "emulated":
        raise ValueError(f"unknown MXFP8 backend {backend!r}: auto, emulated or torchao")
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            swap = {nn.Linear: MXLinear, nn.Embedding: MXEmbedding}.get(type(child))
            if swap is not None and not any(s in full for s in skip):
                child.__class__ = swap  # same parameters and state; only forward/backward change
                count += 1
    return count
