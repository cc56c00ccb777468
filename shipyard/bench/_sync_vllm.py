"""`shipyard bench sync -- --engine vllm`: what a weight push to a vLLM server costs, a whole model against a LoRA
adapter, through the push a run makes (`VLLMEngine.update_weights`, shipyard/models/vllm.py).

For each kind, a server of the model is started by shipyard (`managed_engine`; for LoRA with `--enable-lora`), and
2 × `--pushes` versions are pushed one after the other, each followed by one short greedy request (the push is only
done when the server samples again). In a run a push follows a trainer step, during which the server had nothing to
sample (`max_staleness = 0`), so the figures are of pushes made after `IDLE` seconds without requests; every other
push is made right after a sample instead (`push_busy_s`): for one second after each message, vLLM's worker
busy-polls its queue from the engine core (vLLM's `SpinCondition`, `busy_loop_s = 1`), which on 2 cores takes one
of them from the process writing the push. A full push is the model's bf16 state dict (`checked` against the served
checkpoint, written as one safetensors file, then pause / reload on the workers / version / cache reset / resume); a
LoRA push is an adapter of rank `--lora-rank` on every linear layer of the blocks, its B drawn at random (a trained
adapter), through `/v1/load_lora_adapter`. Dirty pages are written back (`os.sync`) before each kind, so the full
pushes' gigabytes do not slow the adapter's writes. Reported per kind: the bytes written, the write seconds, the
server's seconds (pause to resume), and the whole push — medians over the pushes. Targets (issue 30): a full push of
the 0.5B ≤ 5 s, an adapter ≤ 0.5 s, an adapter ≤ 1/10 of a full push's bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shipyard.bench._common import finish, table
from shipyard.bench._engines import vllm_arguments, vllm_config
from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.lora import LoraConfig, adapter_tensors, attach
from shipyard.models.resolve import load_hf, model_directory
from shipyard.models.vllm_server import managed_engine

IDLE = 2.0  # seconds: longer than vLLM's worker busy-polls after a request (1 s), shorter than any trainer step
TARGETS = {"full_seconds": 5.0, "lora_seconds": 0.5, "lora_bytes_fraction": 0.1}


def pushes(engine, make, count: int, tok) -> dict[str, float]:
    """Push `2 * count` versions made by `make(version)`, each sampled from after: every other one after the server
    was idle for `IDLE` seconds (as after a trainer step), the others right after a sample; the medians of what each
    cost, and the whole push right after a sample (`push_busy_s`)."""
    idle, busy = [], []
    for version in range(1, 2 * count + 1):
        tensors = make(version)
        if version % 2 == 0:
            time.sleep(IDLE)
        t0 = time.perf_counter()
        engine.update_weights(version, tensors)
        seconds = time.perf_counter() - t0
        probe = engine.generate([GenerationRequest(tok.encode("def f(x):"), SamplingParams(max_tokens=2,
                                                                                          temperature=0))])[0]
        if probe.policy_version != version:
            raise SystemExit(f"after push {version} the server sampled with version {probe.policy_version}")
        stats = engine.last_push
        (idle if version % 2 == 0 else busy).append((stats.bytes, stats.write_seconds, stats.reload_seconds, seconds))
    return {"bytes": idle[-1][0], "write_s": round(statistics.median(r[1] for r in idle), 3),
            "server_s": round(statistics.median(r[2] for r in idle), 3),
            "push_s": round(statistics.median(r[3] for r in idle), 3),
            "push_busy_s": round(statistics.median(r[3] for r in busy), 3), "pushes": 2 * count}


def main_vllm(args: argparse.Namespace) -> None:
    model, tok = load_hf(args.model, dtype=torch.bfloat16)
    served = model_directory(args.model)
    config = vllm_config(args, max_model_len=256)
    lora = LoraConfig(enabled=True, rank=args.lora_rank, alpha=2.0 * args.lora_rank)
    adapted = attach(load_hf(args.model, dtype=torch.bfloat16)[0], lora)

    def full(version: int) -> dict[str, torch.Tensor]:
        moved: dict[int, torch.Tensor] = {}  # by memory: a tied head stays the embedding's second name
        with torch.no_grad():  # a new version: every weight moved a little, as after an optimizer step
            return {k: moved.setdefault(v.data_ptr(), v + 1e-3 * version * torch.randn_like(v))
                    for k, v in model.state_dict().items()}

    def adapter(version: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(version)
        return {k: (torch.randn_like(v, dtype=torch.float32) * 0.01) for k, v in
                adapter_tensors(adapted.state_dict()).items()}  # the trainer's adapters are float32

    figures = {}
    for kind, make, settings in (("full", full, None), ("lora", adapter, lora)):
        os.sync()  # the full pushes' gigabytes still being written back must not slow the next kind's writes
        with tempfile.TemporaryDirectory(prefix=f"shipyard-bench-sync-{kind}-") as scratch:
            print(f"starting a vLLM server of {args.model} for {kind} pushes", flush=True)
            with managed_engine(config, served, Path(scratch), tok, lora=settings) as engine:
                figures[kind] = pushes(engine, make, args.pushes, tok)
    fraction = figures["lora"]["bytes"] / figures["full"]["bytes"]
    table(f"pushes to a vLLM server of {args.model} (medians of {args.pushes}; LoRA rank {args.lora_rank})",
          ["push", "MiB", "write s", "server s (pause…resume)", "whole push s", "target s", "right after a sample s"],
          [[k, f"{v['bytes'] / 2**20:.1f}", v["write_s"], v["server_s"], v["push_s"], TARGETS[f"{k}_seconds"],
            v["push_busy_s"]] for k, v in figures.items()])
    met = {"full_seconds": figures["full"]["push_s"] <= TARGETS["full_seconds"],
           "lora_seconds": figures["lora"]["push_s"] <= TARGETS["lora_seconds"],
           "lora_bytes_fraction": fraction <= TARGETS["lora_bytes_fraction"]}
    table("targets", ["target", "measured", "met"],
          [["full push ≤ 5 s", figures["full"]["push_s"], met["full_seconds"]],
           ["LoRA push ≤ 0.5 s", figures["lora"]["push_s"], met["lora_seconds"]],
           ["LoRA bytes ≤ 1/10 of full", f"{fraction:.4f}", met["lora_bytes_fraction"]]])
    finish("sync", {"engine": "vllm", "model": args.model, "lora_rank": args.lora_rank, **figures,
                    "lora_bytes_fraction": round(fraction, 5), "targets": TARGETS, "target_met": met})


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--engine", default="payload", choices=["payload", "vllm"],
                    help="payload: the HTTP push's formats (bf16, MXFP8); vllm: pushes to a vLLM server, full and LoRA")
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=16)
    vllm_arguments(ap, kv_cache_gib=1.0)
