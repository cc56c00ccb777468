"""`shipyard bench engine -- --engines local,vllm`: the loop's samplers side by side — the in-process engine
(`LocalEngine`) and vLLM servers that shipyard starts (`shipyard.models.vllm_server.managed_engine`, the engine
`engine.kind = "vllm"` trains with) — on one rollout-like workload, in one run.

**Workload** (fixed seed, the same requests for every engine): prompts of about `--prompt-tokens` tokens (uniform
within ±20 %), each a distinct slice of the package's own source, so no two share a cached prefix, as the first turns
of different tasks would not; `--new-tokens` sampled tokens each (temperature 1, a seed per request, no stop token:
both engines do exactly the same number of steps). At each concurrency c of `--concurrency`, c threads each send
`--rounds` requests one after the other, as c agents would. Throughput is sampled tokens per wall-clock second
(prefill included: an agent's turn pays for it); the ratio vllm / local at each c is the figure issue 30 targets
(≥ 1.5× at c = 16 on the bundled 0.5B).

Each engine gets one warm-up request first. The engines take turns at each concurrency (local, then vLLM) rather than
one engine's whole sweep after the other's, so load from other jobs on a shared machine falls on both alike. vLLM's
server process is idle while the local engine runs and vice versa; both hold their memory throughout.

The JSON's `tokens_per_s` holds each engine's figure per concurrency, `ratio` vllm/local per concurrency,
`target_met` whether the ratio at the highest concurrency is ≥ 1.5.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
import threading
import time
from pathlib import Path

import torch

from shipyard.bench._common import finish, table
from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.local import LocalEngine
from shipyard.models.resolve import load_hf, model_directory
from shipyard.models.vllm_server import DEFAULT_PYTHON, VLLMConfig, default_cpu_threads, managed_engine

TARGET = 1.5  # vllm / local tokens/s at the highest concurrency (issue 30)


def prompts(corpus: list[int], count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(int(length * 0.8), int(length * 1.2))
        start = rng.randrange(0, len(corpus) - n)
        out.append(corpus[start: start + n])
    return out


def drive(engine, work: list[list[int]], concurrency: int, new_tokens: int, seed: int) -> tuple[float, int]:
    """`concurrency` threads send `work` (its requests dealt out in turn), each waiting for its answer before the
    next; (seconds, sampled tokens)."""
    sampled = [0] * concurrency
    errors: list[BaseException] = []

    def agent(i: int) -> None:
        try:
            for k in range(i, len(work), concurrency):
                sp = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=seed + k, stop_token_ids=())
                sampled[i] += len(engine.generate([GenerationRequest(work[k], sp)])[0].token_ids)
        except BaseException as e:  # reported after the join: a failed engine is no figure
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start, sum(sampled)


def compare(args: argparse.Namespace) -> None:
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = sorted(set(names) - {"local", "vllm"})
    if unknown or not names:
        raise SystemExit(f"--engines names engines among local and vllm, got {args.engines!r}")
    levels = sorted({int(c) for c in args.concurrency.split(",")})
    model, tok = load_hf(args.model, dtype=getattr(torch, args.dtype))
    source = Path(__file__).resolve().parents[1]
    corpus = tok.encode("\n".join(p.read_text() for p in sorted(source.rglob("*.py"))), add_special_tokens=False)
    work = {c: prompts(corpus, c * args.rounds, args.prompt_tokens, args.seed + c) for c in levels}
    engines = {}
    with tempfile.TemporaryDirectory(prefix="shipyard-bench-engines-") as scratch, contextlib.ExitStack() as stack:
        if "local" in names:
            engines["local"] = LocalEngine(model, tok, max_batch=max(levels))
            stack.callback(engines["local"].close)
        if "vllm" in names:
            config = vllm_config(args, max_model_len=int(args.prompt_tokens * 1.2) + args.new_tokens + 16,
                                 dtype=args.dtype)
            print(f"starting a vLLM server of {args.model} (logs in {scratch})", flush=True)
            engines["vllm"] = stack.enter_context(managed_engine(config, model_directory(args.model), Path(scratch),
                                                                 tok))
        for engine in engines.values():  # warm-up: first-call costs are no one's throughput
            drive(engine, [corpus[:64]], 1, 4, args.seed)
        figures: dict[str, dict[str, float]] = {name: {} for name in engines}
        for c in levels:
            for name, engine in engines.items():
                seconds, tokens = drive(engine, work[c], c, args.new_tokens, args.seed)
                if tokens != len(work[c]) * args.new_tokens:
                    raise SystemExit(f"{name} sampled {tokens} tokens at concurrency {c}, not "
                                     f"{len(work[c]) * args.new_tokens}: the engines did not do the same work")
                figures[name][str(c)] = round(tokens / seconds, 2)
                print(f"{name} at concurrency {c}: {tokens} tokens in {seconds:.1f} s", flush=True)
    ratio = ({str(c): round(figures["vllm"][str(c)] / figures["local"][str(c)], 3) for c in levels}
             if len(figures) == 2 else {})
    table(f"{args.model} ({args.dtype}): prompts ~{args.prompt_tokens} tokens, {args.new_tokens} new, "
          f"{args.rounds} rounds per thread — sampled tokens/s",
          ["concurrency", *figures, *(["vllm / local"] if ratio else [])],
          [[c, *(figures[n][str(c)] for n in figures), *([ratio[str(c)]] if ratio else [])] for c in levels])
    top = str(levels[-1])
    finish("engine", {"model": args.model, "dtype": args.dtype, "engines": list(figures), "prompt_tokens":
                      args.prompt_tokens, "new_tokens": args.new_tokens, "rounds": args.rounds,
                      "vllm_cpu_threads": args.cpu_threads, "tokens_per_s": figures, "ratio": ratio,
                      "target": TARGET, "target_met": bool(ratio) and ratio[top] >= TARGET})


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--engines", default="", help="compare these samplers (local,vllm) instead of the batching bench")
    ap.add_argument("--concurrency", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=2, help="requests each thread sends, one after the other")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=256)
    vllm_arguments(ap, kv_cache_gib=4.0)


def vllm_arguments(ap: argparse.ArgumentParser, kv_cache_gib: float) -> None:
    """The options of a benchmark that starts a vLLM server (`vllm_config`)."""
    ap.add_argument("--vllm-python", default=str(DEFAULT_PYTHON), help="vLLM's venv (scripts/install-vllm.sh)")
    ap.add_argument("--cpu-threads", default=default_cpu_threads(), help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--kv-cache-gib", type=float, default=kv_cache_gib)


def vllm_config(args: argparse.Namespace, **settings) -> VLLMConfig:
    """The server `vllm_arguments` describe, with `settings` (max_model_len, dtype, …)."""
    return VLLMConfig(python=Path(args.vllm_python), cpu_threads=args.cpu_threads, kv_cache_gib=args.kv_cache_gib,
                      **settings)
