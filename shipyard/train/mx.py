"""MXFP8 training, emulated: linear and embedding layers that compute with MXFP8-rounded operands.

The number format itself — E4M3 elements sharing an E8M0 scale per block of 32, `quantize` and `dequantize` — is
`shipyard.models.mxformat`, where the engines that load the trainer's MXFP8 payloads find it too.

`MXLinear`'s forward multiplies dequantize(quantize(·)) of the input and of the weight, both blocked along the
reduction dim; the backward quantizes the operands of its two matmuls blocked along *their* reduction dims
(grad_output and weightᵀ along the output features for grad_input; grad_outputᵀ and inputᵀ along the tokens for
grad_weight), as torchao's MX training recipe does. Embedding tables are stored in MXFP8 too (`MXEmbedding`: rows
blocked along the hidden dim, straight-through gradient), so a tied output head and the embedding share one MXFP8
tensor. On Blackwell GPUs torchao's own MXLinear (real MX tensor cores, linear layers only) is used instead
(`convert_to_mxfp8(backend="auto")`).

Because the sampler gets the policy as MXFP8 payloads (`shipyard.models.payload`, quantized with the same `quantize`)
and dequantizes them with the same `dequantize`, it runs on exactly the weights the trainer's forward used: no
post-training quantization step, no drift.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shipyard.models.mxformat import dequantize, quantize


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
