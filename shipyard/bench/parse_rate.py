"""How often a model's sampled turns yield usable tool calls, under both settings of `untagged_calls`.

Runs agent episodes on a copy of the example repository with the demo's planted bug until `--turns` turns have
been sampled (episodes run with untagged="accept" so that they progress). Every sampled turn is parsed twice:
strictly (only `<tool_call>` blocks) and leniently (bare/fenced JSON calls accepted). A turn counts as parsed if
it has at least one call and every call in it parses and validates.

    shipyard bench parse_rate -- --model qwen2.5-coder-0.5b --turns 20
"""

from __future__ import annotations

import argparse
import shutil

from shipyard.bench._common import finish, table
from shipyard.harness.parse import ToolCallParser
from shipyard.harness.tools import default_tools
from shipyard.models.bundled import DEFAULT_MODEL
from shipyard.models.resolve import make_engine
from shipyard.rollout.demo import DEMO_TASK, copy_example, plant_bug
from shipyard.rollout.episode import episode_config, run_on_repo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-turns", type=int, default=6, help="turns per episode")
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()

    engine = make_engine(args.model)
    strict, lenient = ToolCallParser(default_tools(), "reject"), ToolCallParser(default_tools(), "accept")
    counts = {"turns": 0, "strict_parsed": 0, "lenient_parsed": 0, "final": 0, "calls": 0, "valid_calls": 0}
    episodes, seed = [], 0
    while counts["turns"] < args.turns:
        work = copy_example()
        plant_bug(work)
        cfg = episode_config(args.model, max_turns=min(args.max_turns, args.turns - counts["turns"]),
                             temperature=args.temperature, seed=seed, max_new_tokens=512, untagged_calls="accept")
        traj = run_on_repo(DEMO_TASK, work, engine, cfg)
        shutil.rmtree(work.parent, ignore_errors=True)
        for turn in traj.turns:
            s, le = strict.parse(turn.text), lenient.parse(turn.text)
            counts["turns"] += 1
            counts["strict_parsed"] += bool(s.calls) and not any(c.error for c in s.calls)
            counts["lenient_parsed"] += bool(le.calls) and not any(c.error for c in le.calls)
            counts["final"] += le.is_final
            counts["calls"] += len(le.calls)
            counts["valid_calls"] += len(le.valid_calls)
        episodes.append(traj.summary())
        seed += 1
    n = counts["turns"]
    table(f"tool-call parse rate: {args.model}, {n} sampled turns, {len(episodes)} episodes",
          ["setting", "turns parsed", "rate"],
          [["strict (<tool_call> tags only)", counts["strict_parsed"], counts["strict_parsed"] / n],
           ["lenient (untagged JSON accepted)", counts["lenient_parsed"], counts["lenient_parsed"] / n]])
    table("episodes", ["turns", "tool calls", "failed", "stop"],
          [[e["turns"], e["tool_calls"], e["failed_calls"], e["stop_reason"]] for e in episodes])
    finish("parse_rate", {"model": args.model, **counts, "strict_rate": counts["strict_parsed"] / n,
                          "lenient_rate": counts["lenient_parsed"] / n, "episodes": len(episodes)})


if __name__ == "__main__":
    main()
