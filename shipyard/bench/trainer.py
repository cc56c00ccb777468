"""RL training throughput: shipyard's trainer vs TRL's GRPOTrainer on the same model, batches and lengths.

TRL runs in its own venv (`~/.cache/shipyard/bench-trl`, made on first use with `--system-site-packages` and `pip
install trl==1.16.0`, so the project's environment never gets TRL), through `shipyard/bench/_trl_grpo.py`: GRPO on CPU
(float32, or `--dtype bfloat16` mixed precision for both trainers), `--prompts` chat requests × `--generations`
completions per step that end where the model stops (at most `--completion` tokens; `--lengths fixed`: all exactly
`--completion` tokens), AdamW, β = 0, token-level ("dapo") loss, one optimizer step per batch. TRL trains on the
batch as generated — prompts left-padded to the longest prompt, completions right-padded to the longest completion;
shipyard packs the same sequences (`shipyard.train.packing`), so ragged batches cost it only their real tokens.
The TRL side reports each step's wall time and the time spent generating and scoring inside it; TRL's training
time is the difference. It also saves the exact sequences and advantages of every step.

shipyard's `Trainer` (AdamW, token-mean loss, the same learning rate, one micro-batch per step) is then timed on
those same sequences. Training tokens/s = prompt + completion tokens of a batch / training seconds of its step; the
first step of each is a warm-up and not counted; throughput is all tokens of the other steps / all their seconds.
Target: shipyard ≥ 1.5× TRL.

A group step, side by side in the same run on the same trainer (issue 15): `--samples` rows of one `--prompt`-token
prompt (real text: this package's source through the model's tokenizer) with completions of about `--sampled` tokens
(250–350 by default; token ids drawn at random, which costs what real ones do), trained once with the shared prompt
computed once per micro-batch (`shipyard.train.prefix`) and once per sample (`shared_prefix = 0`), both under the
same `micro_batch_tokens` budget (unique tokens). tokens/s = the group's sequence tokens (prompt counted per sample,
as a per-sample trainer sees them) / the step's seconds, so the ratio is the speed-up. Target ≥ 4× at 8 samples of a
1.7k-token prompt and ~300 sampled tokens. `--skip-trl` runs only this part (no TRL venv needed).

The group step also reports memory: the process's resident peak over the trainer's steps (`step_peak_rss_mb`: weights,
optimizer state, gradients, activations) and since it started (`peak_rss_mb`, loading included). `--lora-rank R`
trains a LoRA adapter of rank R (`[trainer.lora]`, α = `--lora-alpha`) on a base frozen in the compute dtype (bf16 with
`--dtype bfloat16`) instead of every weight, so one batch can be timed and sized full vs LoRA and across models
(issue 29: the 0.5B full, the 0.5B LoRA and the 1.5B LoRA, each in its own process, docs/training.md "LoRA").

    shipyard bench trainer [-- --model qwen2.5-coder-0.5b --prompts 2 --generations 4 --completion 128 --steps 6
                              --dtype float32|bfloat16 --lengths natural|fixed
                              --samples 8 --prompt 1700 --sampled 300 --group-steps 2 --skip-trl
                              --lora-rank 0 --lora-alpha 32]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from shipyard.bench._common import console, finish, table
from shipyard.models.bundled import DEFAULT_MODEL
from shipyard.models.lora import LoraConfig
from shipyard.models.resolve import load_hf
from shipyard.train.batch import Batch
from shipyard.train.memory import PeakRSS
from shipyard.train.prefix import groups
from shipyard.train.trainer import OptimConfig, TrainConfig, Trainer

TRL = "trl==1.16.0"
VENV = Path.home() / ".cache" / "shipyard" / "bench-trl"


def trl_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", TRL], check=True)
    return python


def to_batch(b: dict, pad_id: int) -> Batch:
    """TRL's left-padded prompts + completions as one right-padded row per sequence."""
    rows = [torch.cat([p[pm.bool()], c[cm.bool()]]) for p, pm, c, cm in
            zip(b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"], strict=True)]
    n_prompt = [int(pm.sum()) for pm in b["prompt_mask"]]
    width = max(len(r) for r in rows)
    shape = (len(rows), width)
    ids, att = torch.full(shape, pad_id, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    mask, adv = torch.zeros(shape), torch.zeros(shape)
    for i, r in enumerate(rows):
        ids[i, :len(r)], att[i, :len(r)] = r, 1
        mask[i, n_prompt[i]:len(r)] = 1
        adv[i, :len(r)] = float(b["advantages"][i])
    return Batch(ids, att, mask, torch.zeros(shape), adv, torch.zeros(shape, dtype=torch.long),
                 torch.ones(len(rows)), pad_id=pad_id)


def group_batch(tok, samples: int, prompt: int, sampled: int, seed: int = 0) -> Batch:
    """One GRPO group: `samples` rows of the same `prompt`-token prompt, completions of sampled ± 50 tokens."""
    text = "\n".join(p.read_text() for p in sorted(Path(__file__).resolve().parents[1].rglob("*.py")))
    head = torch.tensor(tok(text)["input_ids"][:prompt])
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(sampled - 50, sampled + 51, (samples,), generator=g).tolist()
    rows = [torch.cat([head, torch.randint(0, len(tok), (n,), generator=g)]) for n in lengths]
    shape = (samples, max(len(r) for r in rows))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids, att = torch.full(shape, pad, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    mask, adv = torch.zeros(shape), torch.zeros(shape)
    for i, r in enumerate(rows):
        ids[i, :len(r)], att[i, :len(r)] = r, 1
        mask[i, len(head):len(r)] = 1
        adv[i, :len(r)] = 1.0 if i % 2 else -1.0
    return Batch(ids, att, mask, torch.full(shape, -1.0), adv, torch.zeros(shape, dtype=torch.long),
                 torch.ones(samples), pad_id=pad)


def step_flops(config, lengths: list[int], prompt: int, shared: bool) -> float:
    """Forward FLOPs a group step cannot avoid (backward and recompute scale each term alike, so ratios hold): the
    weight matmuls of every computed position, attention scores and values over each position's context (causal:
    position i sees i + 1 keys; with the prompt once, a sample's token sees the prompt and its own earlier tokens),
    and the output head at the trained positions. Gated MLP and grouped-query attention, as Llama/Qwen."""
    h, layers, heads, kv = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                            config.num_key_value_heads)
    d = h // heads
    per_position = 2 * layers * (2 * h * heads * d + 2 * h * kv * d + 3 * h * config.intermediate_size)
    sampled = [n - prompt for n in lengths]
    if shared:
        positions = prompt + sum(sampled)
        pairs = prompt * (prompt + 1) // 2 + sum(s * prompt + s * (s + 1) // 2 for s in sampled)
    else:
        positions = sum(lengths)
        pairs = sum(n * (n + 1) // 2 for n in lengths)
    return per_position * positions + 4 * layers * heads * d * pairs + 2 * h * config.vocab_size * sum(sampled)


def group_step(args) -> dict:
    """Seconds of a group step with the shared prompt computed once vs per sample, alternating on one trainer."""
    lora = LoraConfig(enabled=True, rank=args.lora_rank, alpha=args.lora_alpha) if args.lora_rank else LoraConfig()
    model, tok = load_hf(args.model, dtype=TrainConfig(compute_dtype=args.dtype, lora=lora).load_dtype)
    batch = group_batch(tok, args.samples, args.prompt, args.sampled)
    # One budget for both: the group's unique tokens (the shared step runs it as one micro-batch) or two rows (the
    # per-sample step runs two rows per micro-batch), whichever is larger.
    lengths = batch.attention_mask.sum(-1).tolist()
    unique = groups(batch.input_ids, lengths, 32)[0].cost(lengths)
    budget = max(unique, 2 * max(lengths)) + 64
    config = TrainConfig(optim=OptimConfig(name="adamw", lr=1e-7, weight_decay=0.0), micro_batch=args.samples,
                         micro_batch_tokens=budget, compute_dtype=args.dtype, lora=lora)
    trainer = Trainer(model, config, pad_id=batch.pad_id)
    shared = trainer.shared_prefix
    warm = group_batch(tok, 2, 64, 16)
    seconds: dict[str, list[float]] = {"shared": [], "per_sample": []}
    forward: dict[str, float] = {}
    with PeakRSS() as peak:
        trainer.step(warm)  # first-call costs (optimizer state, allocator) out of the timings
        for _ in range(args.group_steps):
            for mode, prefix in (("shared", shared), ("per_sample", 0)):
                trainer.shared_prefix = prefix
                t = time.perf_counter()
                metrics = trainer.step(batch)
                seconds[mode].append(time.perf_counter() - t)
                forward[mode] = metrics["forward_tokens"]
    trainer.shared_prefix = shared
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    tokens = int(batch.attention_mask.sum())
    rate = {m: tokens * len(s) / sum(s) for m, s in seconds.items()}
    ratio = rate["shared"] / rate["per_sample"]
    # The arithmetic's ratio bounds what computing the prompt once can buy (the per-sample arm packs without padding).
    flops = {m: step_flops(model.config, lengths, args.prompt, m == "shared") for m in ("shared", "per_sample")}
    ceiling = flops["per_sample"] / flops["shared"]
    per_step = [p / s for s, p in zip(seconds["shared"], seconds["per_sample"], strict=True)]
    what = f"LoRA rank {lora.rank}" if lora.enabled else "full fine-tuning"
    table(f"A group step on {args.model}, {what} ({args.dtype} compute, CPU, {torch.get_num_threads()} threads): "
          f"{args.samples} samples of a {args.prompt}-token prompt, {args.sampled - 50}–{args.sampled + 50} sampled "
          f"tokens each, {tokens} sequence tokens; micro_batch_tokens {budget}",
          ["prompt computed", "positions computed", "forward GFLOP", "s / step (mean)", "tokens/s", "× per sample",
           "× per step"],
          [["once per micro-batch", int(forward["shared"]), flops["shared"] / 1e9,
            statistics.mean(seconds["shared"]), rate["shared"], ratio, " ".join(f"{r:.2f}" for r in per_step)],
           ["per sample", int(forward["per_sample"]), flops["per_sample"] / 1e9,
            statistics.mean(seconds["per_sample"]), rate["per_sample"], 1.0, "—"]])
    console.print(f"arithmetic ceiling of the speed-up (FLOPs per sample / FLOPs once): {ceiling:.2f}×; measured "
                  f"{ratio:.2f}× = {ratio / ceiling:.0%} of it")
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    console.print(f"{trainable / 1e6:.1f} M trained parameters; resident peak over the steps {peak.peak:.0f} MiB, "
                  f"since start {max_rss:.0f} MiB")
    return {"group_samples": args.samples, "group_prompt_tokens": args.prompt, "group_tokens": tokens,
            "group_forward_tokens": forward, "shared_prefix_s": [round(s, 2) for s in seconds["shared"]],
            "per_sample_s": [round(s, 2) for s in seconds["per_sample"]],
            "shared_prefix_tokens_per_s": round(rate["shared"], 1),
            "per_sample_tokens_per_s": round(rate["per_sample"], 1), "shared_prefix_ratio": round(ratio, 2),
            "shared_prefix_flop_ratio": round(ceiling, 2),
            "shared_prefix_target_met": ratio >= 4.0, "lora_rank": lora.rank if lora.enabled else 0,
            "trainable_params": trainable, "step_peak_rss_mb": round(peak.peak), "peak_rss_mb": round(max_rss)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="compute precision of both trainers (float32 master weights either way)")
    ap.add_argument("--lengths", choices=("natural", "fixed"), default="natural",
                    help="completions end where the model stops (at most --completion tokens), or all exactly "
                         "--completion tokens long")
    ap.add_argument("--samples", type=int, default=8, help="group step: samples of one prompt")
    ap.add_argument("--prompt", type=int, default=1700, help="group step: prompt tokens")
    ap.add_argument("--sampled", type=int, default=300, help="group step: mean sampled tokens per sample")
    ap.add_argument("--group-steps", type=int, default=2, help="group step: timed steps of each kind")
    ap.add_argument("--skip-trl", action="store_true", help="only the group step (no TRL venv)")
    ap.add_argument("--lora-rank", type=int, default=0, help="group step: train a LoRA adapter of this rank (0: every "
                                                             "weight)")
    ap.add_argument("--lora-alpha", type=float, default=32.0, help="group step: the LoRA update's scale α (α / rank)")
    args = ap.parse_args()
    if args.skip_trl:
        finish("trainer", {"model": args.model, "dtype": args.dtype, **group_step(args)})
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trl.pt"
        cmd = [str(trl_python()), "-m", "shipyard.bench._trl_grpo", "--model", args.model, "--out",
               str(out), "--prompts", str(args.prompts), "--generations", str(args.generations), "--completion",
               str(args.completion), "--steps", str(args.steps), "--lr", str(args.lr), "--dtype", args.dtype,
               "--lengths", args.lengths]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the TRL run failed:\n{proc.stderr[-3000:]}")
        trl = torch.load(out)
    batches = [to_batch(b, trl["pad_id"]) for b in trl["batches"]]
    tokens = [int(b.attention_mask.sum()) for b in batches]
    # Positions TRL's forward computes: every row is as wide as the longest prompt plus the longest completion.
    trl_positions = [b["prompt_ids"].numel() + b["completion_ids"].numel() for b in trl["batches"]]
    padding = statistics.mean(1 - n / p for n, p in zip(tokens, trl_positions, strict=True))
    trl_train = [s - g for s, g in zip(trl["step_seconds"], trl["generation_seconds"], strict=True)]

    model, _ = load_hf(args.model, dtype=torch.float32)
    trainer = Trainer(model, TrainConfig(optim=OptimConfig(name="adamw", lr=args.lr, weight_decay=0.0),
                                         micro_batch=batches[0].size, compute_dtype=args.dtype),
                      pad_id=trl["pad_id"])
    ours = []
    for b in batches:
        t = time.perf_counter()
        trainer.step(b)
        ours.append(time.perf_counter() - t)
    # Throughput over the run: all tokens of the timed steps / all their seconds (steps differ in size).
    ours_rate, trl_rate = sum(tokens[1:]) / sum(ours[1:]), sum(tokens[1:]) / sum(trl_train[1:])
    per_step = [t / o for t, o in zip(trl_train[1:], ours[1:], strict=True)]
    table(f"RL training throughput on {args.model} ({args.dtype} compute, CPU, {trl['threads']} threads; "
          f"{batches[0].size} sequences, {statistics.mean(tokens):.0f} tokens per step on average, "
          f"{padding:.0%} of TRL's positions padding)",
          ["trainer", "train s / step (mean)", "generation s / step (TRL)", "training tokens/s", "× TRL",
           "× TRL per step"],
          [["TRL GRPOTrainer", statistics.mean(trl_train[1:]), statistics.mean(trl["generation_seconds"][1:]),
            trl_rate, 1.0, "—"],
           ["shipyard Trainer", statistics.mean(ours[1:]), "—", ours_rate, ours_rate / trl_rate,
            " ".join(f"{r:.2f}" for r in per_step)]])
    del trainer, model  # the group step loads its own copy
    group = group_step(args)
    finish("trainer", {"model": args.model, "dtype": args.dtype, "lengths": args.lengths, **group,
                       "sequences": batches[0].size, "tokens_per_step": tokens, "trl_positions_per_step": trl_positions,
                       "trl_train_s": [round(s, 3) for s in trl_train], "ours_s": [round(s, 3) for s in ours],
                       "trl_tokens_per_s": round(trl_rate, 1), "ours_tokens_per_s": round(ours_rate, 1),
                       "ratio": round(ours_rate / trl_rate, 3), "target_met": ours_rate / trl_rate >= 1.5})


if __name__ == "__main__":
    main()
