"""Which floating-point dtype a device computes in. bfloat16 halves memory and is the training dtype on GPUs, but only
where the device has bf16 arithmetic: oneDNN's CPU kernels need AVX512 (AVX512-BF16 or AMX at full speed), and on an
AVX2-only CPU a bf16 matmul falls back to a reference loop hundreds of times slower than float32's. Every "auto" dtype
in shipyard (the trainer's compute dtype, vLLM's dtype, the in-process engine's default) is decided here, by the device
it runs on, so that one machine's answer is never another's default.

Kept apart from `shipyard.models.resolve` (which builds engines, and so imports the vLLM launcher) because the vLLM
launcher asks it too; it imports torch only.
"""

from __future__ import annotations

import warnings

import torch


def native_bfloat16(device: str) -> bool:
    """Whether `device` multiplies bfloat16 matrices in hardware. CUDA: the GPU says (Ampere and newer). CPU: oneDNN's
    bf16 kernels need AVX512 (AVX512-BF16 or AMX at full speed); on an AVX2-only CPU (many AMD EPYC and older Intel
    servers) a bf16 matmul falls back to a reference loop: 0.3 GFLOP/s against fp32's 103 on a 2-core AMD EPYC VM
    (2048² matmul, 2026-12-07), which made a LoRA SFT step of the 0.5B run past 14 minutes instead of ~4."""
    where = torch.device(device)
    if where.type == "cuda":
        if not torch.cuda.is_available():
            return False
        with torch.cuda.device(where):
            return torch.cuda.is_bf16_supported(including_emulation=False)
    if where.type == "cpu":  # a build without oneDNN has no bf16 kernels at all (and no such op)
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True  # mps, xpu: their backends choose; nothing known to be slow


def default_dtype(device: str) -> torch.dtype:
    # bf16 halves memory and is the training dtype on GPUs; on CPUs with AVX512-BF16 it also ran 2x faster than fp32
    # (Qwen2.5-0.5B: prefill of 1500 tokens 2.3 s vs 4.7 s, decode 11.3 vs 5.3 tok/s). Where the device has no bf16
    # arithmetic (`native_bfloat16`) float32 instead: bf16 there is hundreds of times slower.
    return torch.bfloat16 if native_bfloat16(device) else torch.float32


def resolve_dtype(requested: str, device: str) -> str:
    """The dtype name a `"auto"` setting (the trainer's compute dtype, vLLM's dtype) means on `device`: bfloat16 where
    it is native, else float32. An explicit "bfloat16" on a device without it is kept, with a warning that says
    what it costs and what to set instead."""
    if requested == "auto":
        return "bfloat16" if native_bfloat16(device) else "float32"
    if requested == "bfloat16" and not native_bfloat16(device):
        which = "a CPU without AVX512" if torch.device(device).type == "cpu" else "a GPU older than Ampere"
        warnings.warn(f"bfloat16 on {device}, which has no bfloat16 arithmetic ({which}): it runs emulated, on a CPU "
                      f"hundreds of times slower than float32. Set the dtype to \"auto\" or \"float32\"", stacklevel=3)
    return requested
