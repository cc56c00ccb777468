"""Weight-sync payloads: MXFP8 vs bf16 bytes, encode/decode time, and the round-trip error, on a bundled model.

For the model's state dict: a bf16 payload and an MXFP8 payload (linear layers but the head quantized, as the MXFP8
trainer runs them); bytes, ratio (target <= 0.53x bf16), seconds to encode and to decode; the relative error of
the quantized matrices (‖dequantized − w‖ / ‖w‖ per tensor: mean and worst) and, end to end, the KL divergence
between the next-token distributions of the bf16 model and of the model loaded from the MXFP8 payload on a prompt
(post-training quantization of a model not trained in MXFP8: the error MXFP8 training removes).

    shipyard bench sync [-- --model qwen2.5-coder-0.5b]

With `--engine vllm`, the pushes to a vLLM server instead: a whole model against a LoRA adapter, bytes and seconds
(shipyard/bench/_sync_vllm.py).

    shipyard bench sync -- --engine vllm [--lora-rank 16 --pushes 3 --vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import time

import torch

from shipyard.bench._common import finish, table
from shipyard.bench._sync_vllm import add_arguments, main_vllm
from shipyard.models.bundled import DEFAULT_MODEL
from shipyard.models.payload import decode, encode
from shipyard.models.resolve import load_hf
from shipyard.train.sync import mx_weight_names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    add_arguments(ap)
    args = ap.parse_args()
    if args.engine == "vllm":
        main_vllm(args)
        return
    model, tok = load_hf(args.model, dtype=torch.bfloat16)
    state = model.state_dict()
    names = mx_weight_names(model)
    rows, figures = [], {}
    for fmt in ("bf16", "mxfp8"):
        t0 = time.perf_counter()
        payload = encode(state, 1, fmt, names)
        t1 = time.perf_counter()
        _, tensors = decode(payload)
        t2 = time.perf_counter()
        figures[fmt] = {"bytes": len(payload), "encode_s": round(t1 - t0, 3), "decode_s": round(t2 - t1, 3)}
        rows.append([fmt, f"{len(payload) / 2**20:.1f}", t1 - t0, t2 - t1])
        if fmt == "mxfp8":
            errors = [float((tensors[n].float() - state[n].float()).norm() / state[n].float().norm()) for n in names]
            mx_tensors = tensors
    ratio = figures["mxfp8"]["bytes"] / figures["bf16"]["bytes"]
    table(f"weight payloads of {args.model} ({len(names)} of {len(state)} tensors quantized)",
          ["format", "MiB", "encode s", "decode s"], rows)
    prompt = tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", return_tensors="pt")
    with torch.no_grad():
        ref = model(**prompt).logits.float().log_softmax(-1)
        model.load_state_dict(mx_tensors, strict=False)
        got = model(**prompt).logits.float().log_softmax(-1)
    kl = float((ref.exp() * (ref - got)).sum(-1).mean())
    agree = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    table("round trip", ["", "value"], [
        ["MXFP8 / bf16 bytes (target <= 0.53)", f"{ratio:.3f}"],
        ["relative error per matrix, mean", f"{sum(errors) / len(errors):.4f}"],
        ["relative error per matrix, worst", f"{max(errors):.4f}"],
        ["KL(bf16 ‖ MXFP8) per token, prompt", f"{kl:.5f}"],
        ["greedy next-token agreement", f"{agree:.3f}"]])
    finish("sync", {"model": args.model, **figures, "ratio": round(ratio, 4),
                    "rel_error_mean": round(sum(errors) / len(errors), 5), "rel_error_max": round(max(errors), 5),
                    "kl_per_token": round(kl, 6), "greedy_agreement": round(agree, 4), "target_met": ratio <= 0.53})


if __name__ == "__main__":
    main()
