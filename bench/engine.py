"""LocalEngine speed on this machine: prefill and decode per dtype, batching, and the prefix cache.

All figures are measured side by side in one run (the machine is shared; compare ratios, not absolutes):
- prefill seconds for a `--prompt`-token prompt and decode tokens/s at batch 1, for float32 and bfloat16;
- aggregate decode tokens/s at batch `--batch` (bf16);
- an agent's second turn (previous context + 300 new tokens): prefill with the prefix cache vs without.

    shipyard bench engine [-- --model qwen2.5-coder-0.5b --prompt 1500 --new 48 --batch 8]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import finish, table

from shipyard.models.bundled import DEFAULT_MODEL
from shipyard.models.engine import GenerationRequest, SamplingParams
from shipyard.models.local import LocalEngine
from shipyard.models.resolve import load_hf


def timed(engine: LocalEngine, reqs: list[GenerationRequest]) -> tuple[float, int]:
    t = time.perf_counter()
    out = engine.generate(reqs)
    return time.perf_counter() - t, sum(len(c.token_ids) for c in out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompt", type=int, default=1500)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=())  # noqa: E731
    rows, figures = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        model, tok = load_hf(args.model, dtype=dtype)
        engine = LocalEngine(model, tok, prefix_cache=False, max_batch=args.batch)
        ids = (tok.encode("def fibonacci(n):\n    return n\n" * 400, add_special_tokens=False))[: args.prompt]
        timed(engine, [GenerationRequest(ids[:64], greedy(2))])  # warm-up
        prefill, _ = timed(engine, [GenerationRequest(ids, greedy(1))])
        dt, n = timed(engine, [GenerationRequest(ids[:32], greedy(args.new))])
        name = str(dtype).removeprefix("torch.")
        rows.append([name, prefill, n / dt])
        figures[name] = {"prefill_s": round(prefill, 3), "decode_tok_s": round(n / dt, 2)}
        if dtype == torch.bfloat16:
            dt, n = timed(engine, [GenerationRequest(ids[i * 7: i * 7 + 32], greedy(args.new))
                                   for i in range(args.batch)])
            figures["bf16_batch_decode_tok_s"] = round(n / dt, 2)
            cached = LocalEngine(model, tok, prefix_cache=True)
            first = cached.generate([GenerationRequest(ids, greedy(8))])[0]
            second = ids + first.token_ids + tok.encode(" observation" * 150, add_special_tokens=False)[:300]
            with_cache, _ = timed(cached, [GenerationRequest(second, greedy(1))])
            without, _ = timed(engine, [GenerationRequest(second, greedy(1))])
            figures["second_turn_prefill_s"] = {"prefix_cache": round(with_cache, 3), "no_cache": round(without, 3)}
        del engine, model
    table(f"{args.model}: prefill of {args.prompt} tokens and batch-1 decode", ["dtype", "prefill s", "decode tok/s"],
          rows)
    table("batching and prefix cache (bf16)", ["what", "value"],
          [[f"aggregate decode tok/s at batch {args.batch}", figures["bf16_batch_decode_tok_s"]],
           ["2nd-turn prefill, prefix cache (s)", figures["second_turn_prefill_s"]["prefix_cache"]],
           ["2nd-turn prefill, no cache (s)", figures["second_turn_prefill_s"]["no_cache"]]])
    finish("engine", {"model": args.model, "prompt_tokens": args.prompt, **figures})


if __name__ == "__main__":
    main()
