"""Optimizer step time: Muon (+ AdamW for embeddings, head, norms, biases) vs AdamW, and Muon sharded over ranks.

1. On the bundled model (float32 master weights, fixed random gradients): the median time of `--steps` optimizer
   steps for AdamW over every parameter, for shipyard's Muon (q/k/v per head) + AdamW, and for torch.optim.Muon +
   AdamW (whole matrices) for reference; every AdamW is the fused kernel, as in the trainer. Target: Muon <= 1.5x
   AdamW. Also the Newton–Schulz work of a step — 5 iterations of X·Xᵀ, A·A and B·X per unit, 5·(4m²n + 2m³)
   FLOP for an m × n unit (m ≤ n) — and the rate it implies: the step is compute-bound where AdamW is a
   memory-bound elementwise pass, so the ratio depends on the machine's FLOP/byte.
2. Sharded: the decoder matrices of the first `--layers` layers as FSDP-style Shard(0) DTensors over 1, 2 and 4
   gloo ranks (processes on this machine); Muon step time (all-to-all of split heads included). On a 2-core machine
   more ranks than cores measures overhead, not speed-up.

    shipyard bench optim [-- --model qwen2.5-coder-0.5b --steps 3 --layers 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from shipyard.bench._common import finish, table
from shipyard.models.bundled import DEFAULT_MODEL
from shipyard.models.resolve import load_hf
from shipyard.train.muon import Muon, _layout, muon_param_groups


def _grads(params, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3


def ns_flops(groups) -> int:
    """FLOP of one Newton–Schulz pass over every Muon unit of `groups` (plain tensors)."""
    total = 0
    for g in groups:
        for p in g["params"]:
            lay, _ = _layout(p, g.get("unit_rows"))
            m, n = sorted((lay.unit_rows, lay.cols))
            total += (lay.n // lay.unit_rows) * g.get("ns_steps", 5) * (4 * m * m * n + 2 * m ** 3)
    return total


def _time(opts, params, steps) -> float:
    _grads(params)
    for o in opts:  # warm-up: state allocation
        o.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for o in opts:
            o.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _sharded_worker(rank, world, port, model, layers, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, os.cpu_count() // world))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        net, _ = load_hf(model, dtype=torch.float32)
        groups, _ = muon_param_groups(net)
        keep = {f"layers.{i}." for i in range(layers)}
        names = {id(p): n for n, p in net.named_parameters()}
        sharded = []
        for g in groups:
            ps = [torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in g["params"]
                  if any(k in names[id(p)] for k in keep)]
            if ps:
                sharded.append({"params": ps, "unit_rows": g["unit_rows"]})
        params = [p for g in sharded for p in g["params"]]
        gen = torch.Generator().manual_seed(0)
        for p in params:
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen) * 1e-3, mesh, [Shard(0)])
        opt = Muon(sharded, lr=1e-3)
        opt.step()
        times = []
        for _ in range(steps):
            torch.distributed.barrier()
            t = time.perf_counter()
            opt.step()
            torch.distributed.barrier()
            times.append(time.perf_counter() - t)
        if rank == 0:
            Path(out).write_text(f"{statistics.median(times)} {sum(p.numel() for p in params)}")
    finally:
        torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    model, _ = load_hf(args.model, dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    adamw = _time([torch.optim.AdamW(params, lr=1e-3, fused=True)], params, args.steps)
    muon_groups, adamw_groups = muon_param_groups(model)
    ours = _time([Muon(muon_groups, lr=1e-3), torch.optim.AdamW(adamw_groups, lr=1e-3, fused=True)], params,
                 args.steps)
    matrices = [p for g in muon_groups for p in g["params"] if p.ndim == 2]
    torch_muon = _time([torch.optim.Muon(matrices, lr=1e-3, adjust_lr_fn="match_rms_adamw"),
                        torch.optim.AdamW(adamw_groups, lr=1e-3, fused=True)], params, args.steps)
    flops, whole = ns_flops(muon_groups), ns_flops([{"params": matrices}])
    table(f"optimizer step on {args.model} ({n / 1e6:.0f}M parameters, float32, {torch.get_num_threads()} threads)",
          ["optimizer", "step s", "x AdamW", "Newton–Schulz TFLOP", "TFLOP/s if all Newton–Schulz"],
          [["AdamW (all parameters)", adamw, 1.0, "—", "—"],
           ["shipyard Muon (per head) + AdamW", ours, ours / adamw, flops / 1e12, flops / ours / 1e12],
           ["torch.optim.Muon (whole matrices) + AdamW", torch_muon, torch_muon / adamw, whole / 1e12,
            whole / torch_muon / 1e12]])
    sharded = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2, 4):
            out = Path(tmp) / f"{world}.txt"
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_sharded_worker, args=(world, port, args.model, args.layers, args.steps, str(out)),
                     nprocs=world)
            seconds, count = out.read_text().split()
            sharded[world] = float(seconds)
    table(f"sharded Muon step: matrices of the first {args.layers} layers ({int(count) / 1e6:.0f}M parameters)",
          ["gloo ranks", "step s", "x 1 rank"], [[w, s, s / sharded[1]] for w, s in sharded.items()])
    finish("optim", {"model": args.model, "parameters": n, "adamw_s": round(adamw, 3), "muon_s": round(ours, 3),
                     "torch_muon_s": round(torch_muon, 3), "muon_over_adamw": round(ours / adamw, 3),
                     "ns_tflop": round(flops / 1e12, 3), "torch_ns_tflop": round(whole / 1e12, 3),
                     "target_met": ours / adamw <= 1.5, "sharded_s": {str(k): round(v, 3) for k, v in sharded.items()},
                     "cpus": os.cpu_count()})


if __name__ == "__main__":
    main()
