"""Harness overheads: what each tool call costs, and what parallel tool calls buy.

1. Per-call overhead: for every tool, the median wall time of one call through the real executor on a copy of
   the example repository (parsing and schema validation measured separately).
2. Parallelism: one turn of 8 `run_terminal` calls that each sleep 0.3 s, run by the agent loop as usual
   (parallel) and with `max_parallel=1` (forced serial). Target: parallel <= 1.3/8 of serial.

    shipyard bench harness [-- --repeats 30]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from shipyard.bench._common import finish, table
from shipyard.harness.loop import Agent, LoopConfig, ToolExecutor
from shipyard.harness.parse import ToolCallParser
from shipyard.harness.tools import ToolContext, default_tools
from shipyard.harness.workspace import LocalWorkspace
from shipyard.models.replay import ReplayEngine
from shipyard.rollout.demo import EXAMPLE_REPO


def tagged(name: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>\n'


CALLS = [
    ("read_file", {"path": "pocketlib/roman.py"}),
    ("list_dir", {"path": "pocketlib"}),
    ("glob", {"pattern": "**/*.py"}),
    ("grep", {"pattern": "def to_roman"}),
    ("search_replace", {"path": "pocketlib/stats.py", "old_string": "def mean(", "new_string": "def mean ("}),
    ("search_replace", {"path": "pocketlib/stats.py", "old_string": "def mean (", "new_string": "def mean("}),
    ("write_file", {"path": "scratch.txt", "content": "hello\n"}),
    ("delete_file", {"path": "scratch.txt"}),
    ("read_lints", {"paths": ["pocketlib/roman.py"]}),
    ("run_terminal", {"command": "true"}),
    ("todo_write", {"todos": [{"id": "1", "content": "x", "status": "pending"}]}),
]


def per_call(repo: Path, repeats: int) -> tuple[list[list], dict[str, float]]:
    tools = default_tools()
    parser = ToolCallParser(tools)
    ws = LocalWorkspace(repo)
    ctx = ToolContext(ws)
    executor = ToolExecutor(tools, ctx)
    samples: dict[str, list[float]] = {}
    parse_times = []
    for _ in range(repeats):
        for name, args in CALLS:
            text = tagged(name, **args)
            t0 = time.perf_counter()
            call = parser.parse(text).calls[0]
            parse_times.append(time.perf_counter() - t0)
            record = executor.execute([call])[0]
            assert record.error is None, record.error
            samples.setdefault(name, []).append(record.seconds)
    executor.close()
    ctx.close()
    ws.close()
    medians = {name: statistics.median(v) * 1000 for name, v in samples.items()}
    medians["parse+validate"] = statistics.median(parse_times) * 1000
    return [[k, v] for k, v in medians.items()], medians


def parallel_turn(repo: Path, max_parallel: int) -> float:
    turn = "".join(tagged("run_terminal", command=f"sleep 0.3; echo {i}") for i in range(8))
    ws = LocalWorkspace(repo)
    traj = Agent(ReplayEngine([turn, "done"]), ws, LoopConfig(max_parallel=max_parallel)).run("bench")
    ws.close()
    return traj.turns[0].tools_seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    repo = Path(tempfile.mkdtemp(prefix="shipyard-bench-")) / "repo"
    shutil.copytree(EXAMPLE_REPO, repo)
    rows, medians = per_call(repo, args.repeats)
    table(f"per-call tool overhead (median of {args.repeats}, ms)", ["tool", "ms"], rows)
    parallel = min(parallel_turn(repo, 16) for _ in range(3))
    serial = min(parallel_turn(repo, 1) for _ in range(3))
    ratio = parallel / serial
    table("8 x run_terminal 'sleep 0.3' in one turn (best of 3, s)", ["mode", "seconds", "ratio"],
          [["parallel", parallel, ratio], ["forced serial", serial, 1.0], ["target", "", 1.3 / 8]])
    shutil.rmtree(repo.parent, ignore_errors=True)
    finish("harness", {"per_call_ms": {k: round(v, 3) for k, v in medians.items()},
                       "parallel_s": round(parallel, 3), "serial_s": round(serial, 3),
                       "parallel_over_serial": round(ratio, 4), "target": 1.3 / 8, "pass": ratio <= 1.3 / 8})


if __name__ == "__main__":
    main()
