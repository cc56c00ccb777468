"""`shipyard bench engine`: continuous batching (`LocalEngine`) against static batching (transformers `generate`) on
a multi-turn, agent-like workload, at equal concurrency; then a group's shared prefill.

The workload (fixed seed, identical for both modes): `--sessions` agents run `--turns` turns each. Every prompt
starts with one long shared system prompt and a per-session task; after each turn the agent's context grows by its
own output and a tool observation. Output lengths are heavy-tailed (log-normal, clipped), like an agent that mostly
writes a short tool call and sometimes a long patch; observations likewise. Both modes generate exactly the planned
number of tokens per turn (greedy, no stop token), so they do the same useful work:

* **static**: turn by turn, the sessions' contexts form one left-padded batch for `model.generate`, which prefills
  every full context again (no cache across calls) and decodes until the longest output of the batch is done;
* **continuous**: one thread per session calls `LocalEngine.generate` with its session id; the engine decodes all
  running sequences together, admits a turn as soon as a slot is free, keeps each session's cache between turns
  (only the new tokens are prefilled) and shares the system prompt's prefix between sessions.

Throughput is useful tokens (the planned outputs) per wall-clock second. The group part times 8 requests for one
`--group-prompt`-token prompt with seeds 0..7, with the prefill shared (one prefill, the siblings reuse its cache) and
without (`prefix_cache=False`: 8 prefills), and counts the distinct samples.

The machine is shared with other jobs: compare the ratio, not the absolute figures. Memory is the process's resident
set (sampled every 20 ms per phase; `peak_memory_mb` is the whole run's maximum).

    shipyard bench engine [-- --model smollm2-135m --sessions 6 --turns 3 --threads 1]

With `--engines local,vllm` it compares the loop's samplers instead: the in-process engine and vLLM servers, tokens/s
at concurrency 1/8/16 on ~1k-token prompts and 256 new tokens (shipyard/bench/_engines.py).

    shipyard bench engine -- --engines local,vllm [--concurrency 1,8,16 --vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import math
import random
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shipyard.bench._common import finish, table
from shipyard.bench._engines import add_arguments, compare
from shipyard.models.bundled import DEFAULT_MODEL
from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.local import LocalEngine
from shipyard.models.resolve import load_hf
from shipyard.train.memory import PeakRSS

SOURCE = Path(__file__).resolve().parents[1]  # text to tokenize: the package's own source


@dataclass
class Plan:
    """One session: its first prompt, and per turn the tokens to generate and the observation that follows."""

    prompt: list[int]
    outputs: list[int]
    observations: list[list[int]]


def heavy_tailed(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(rng.lognormvariate(math.log(median), sigma))))


def workload(corpus: list[int], args: argparse.Namespace) -> list[Plan]:
    rng = random.Random(args.seed)
    system = corpus[: args.system]
    plans = []
    for _ in range(args.sessions):
        start = rng.randrange(args.system, len(corpus) - 2000)
        task = corpus[start: start + rng.randint(40, 120)]
        outputs = [heavy_tailed(rng, args.output_median, 0.9, 4, args.output_max) for _ in range(args.turns)]
        observations = []
        for _ in range(args.turns - 1):
            at = rng.randrange(args.system, len(corpus) - 2000)
            observations.append(corpus[at: at + heavy_tailed(rng, args.observation_median, 0.8, 16, 600)])
        plans.append(Plan(system + task, outputs, observations))
    return plans


def run_static(model, pad_id: int, plans: list[Plan]) -> tuple[float, int]:
    contexts = [list(p.prompt) for p in plans]
    useful = 0
    start = time.perf_counter()
    for turn in range(len(plans[0].outputs)):
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, c in enumerate(contexts):
            ids[row, width - len(c):] = torch.tensor(c)
            mask[row, width - len(c):] = 1
        longest = max(p.outputs[turn] for p in plans)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=pad_id)
        for row, p in enumerate(plans):
            produced = out[row, width: width + p.outputs[turn]].tolist()
            useful += len(produced)
            contexts[row] += produced + (p.observations[turn] if turn < len(p.observations) else [])
    return time.perf_counter() - start, useful


def run_continuous(engine: LocalEngine, plans: list[Plan]) -> tuple[float, int]:
    useful = [0] * len(plans)

    def agent(i: int) -> None:
        p, context = plans[i], list(plans[i].prompt)
        for turn, n in enumerate(p.outputs):
            sp = SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=())
            c = engine.generate([GenerationRequest(context, sp, session=f"session-{i}")])[0]
            useful[i] += len(c.token_ids)
            context += c.token_ids + (p.observations[turn] if turn < len(p.observations) else [])

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(plans))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, sum(useful)


def run_group(model, tok, prompt: list[int], new: int, shared: bool) -> dict:
    engine = LocalEngine(model, tok, max_batch=8, prefix_cache=shared)
    reqs = [GenerationRequest(prompt, SamplingParams(max_tokens=new, temperature=1.0, seed=k, stop_token_ids=()),
                              session=f"group-{k}") for k in range(8)]
    start = time.perf_counter()
    out = engine.generate(reqs)
    seconds = time.perf_counter() - start
    engine.close()
    return {"seconds": round(seconds, 2), "prefill_tokens": engine.stats["prefill_tokens"],
            "distinct_samples": len({tuple(c.token_ids) for c in out})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: smollm2-135m; with --engines the bundled 0.5B")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--sessions", type=int, default=6, help="agents at once: the concurrency of both modes")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system", type=int, default=320, help="tokens of the shared system prompt")
    ap.add_argument("--output-median", type=float, default=20)
    ap.add_argument("--output-max", type=int, default=128)
    ap.add_argument("--observation-median", type=float, default=90)
    ap.add_argument("--group-prompt", type=int, default=512)
    ap.add_argument("--group-new", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    add_arguments(ap)
    args = ap.parse_args()
    if args.engines:  # the samplers side by side (shipyard/bench/_engines.py)
        args.model = args.model or DEFAULT_MODEL
        compare(args)
        return
    args.model = args.model or "smollm2-135m"
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_hf(args.model, dtype=getattr(torch, args.dtype))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    text = "\n".join(p.read_text() for p in sorted(SOURCE.rglob("*.py")))
    corpus = tok.encode(text, add_special_tokens=False)
    plans = workload(corpus, args)
    planned = sum(sum(p.outputs) for p in plans)

    engine = LocalEngine(model, tok, max_batch=args.sessions)
    engine.generate([GenerationRequest(corpus[:16], SamplingParams(max_tokens=2, temperature=0.0))])  # warm-up
    with torch.inference_mode():
        model.generate(input_ids=torch.tensor([corpus[:16]]), max_new_tokens=2, do_sample=False, pad_token_id=pad)
    with PeakRSS(period=0.02) as static_rss:
        static_s, static_tokens = run_static(model, pad, plans)
    engine.stats.update(dict.fromkeys(engine.stats, 0))
    engine.clear_cache()  # the warm-up's cache must not help the measured run
    with PeakRSS(period=0.02) as cont_rss:
        cont_s, cont_tokens = run_continuous(engine, plans)
    stats = dict(engine.stats)
    engine.close()
    assert static_tokens == cont_tokens == planned, (static_tokens, cont_tokens, planned)
    static_tps, cont_tps = static_tokens / static_s, cont_tokens / cont_s
    contexts = [len(p.prompt) + sum(p.outputs[:-1]) + sum(len(o) for o in p.observations) for p in plans]
    table(f"{args.model} ({args.dtype}): {args.sessions} sessions × {args.turns} turns, {planned} output tokens "
          f"(lengths {min(min(p.outputs) for p in plans)}–{max(max(p.outputs) for p in plans)}), final contexts "
          f"{min(contexts)}–{max(contexts)} tokens",
          ["mode", "seconds", "tokens/s", "peak RSS MB"],
          [["static (transformers generate)", static_s, static_tps, static_rss.peak],
           ["continuous (LocalEngine)", cont_s, cont_tps, cont_rss.peak]])
    table("continuous engine counters", ["counter", "value"], [[k, v] for k, v in stats.items()])

    prompt = corpus[: args.group_prompt]
    group = {"shared": run_group(model, tok, prompt, args.group_new, True),
             "separate": run_group(model, tok, prompt, args.group_new, False)}
    table(f"8 requests for one {len(prompt)}-token prompt, seeds 0..7", ["prefill", "seconds", "prefill tokens",
                                                                          "distinct samples"],
          [[k, v["seconds"], v["prefill_tokens"], v["distinct_samples"]] for k, v in group.items()])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finish("engine", {
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "sessions": args.sessions,
        "turns": args.turns, "output_tokens": planned,
        "continuous_tokens_per_s": round(cont_tps, 2), "static_tokens_per_s": round(static_tps, 2),
        "ratio": round(cont_tps / static_tps, 2), "continuous_seconds": round(cont_s, 1),
        "static_seconds": round(static_s, 1), "peak_memory_mb": round(peak, 1),
        "peak_rss_mb": {"static": round(static_rss.peak, 1), "continuous": round(cont_rss.peak, 1)},
        "continuous_prefill_tokens": stats["prefill_tokens"], "continuous_reused_tokens": stats["reused_tokens"],
        "group_prefill": {"prompt_tokens": len(prompt), "shared_s": group["shared"]["seconds"],
                          "separate_s": group["separate"]["seconds"],
                          "shared_prefill_tokens": group["shared"]["prefill_tokens"],
                          "separate_prefill_tokens": group["separate"]["prefill_tokens"]},
        "distinct_samples": group["shared"]["distinct_samples"],
    })


if __name__ == "__main__":
    main()
