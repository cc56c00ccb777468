"""What the benchmarks made of whole commands share (`shipyard bench learning`, `shipyard bench lora`): a stage run as
a subprocess with its log, killed with its children past its budget; a training run directory read as such a
benchmark sees it; small readers of the JSON files they keep."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.progress import Progress, TimeElapsedColumn

from shipyard.bench._common import console
from shipyard.lifetime import die_with_parent, popen


def run_stage(label: str, cmd: list[str], log: Path, minutes: float | None, done: Callable[[], int],
              total: int | None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` (with `env` added to the environment) and its output in `log`, killed (its whole process group)
    past `minutes` and when the benchmark ends, however it ends; what happened."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = None if minutes is None else start + minutes * 60
    rc, cut = None, False
    with open(log, "w") as out, Progress(*Progress.get_default_columns(), TimeElapsedColumn(),
                                          console=console) as progress:
        bar = progress.add_task(escape(f"{label} (log: {log})"), total=total)
        # SIGKILL or SIGTERM of the benchmark (which skips the `finally` below) ends the stage too: the kernel sends
        # it SIGTERM (`die_with_parent`); before, a killed `bench learning` left its evaluation running for an hour
        proc = popen(die_with_parent(cmd), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                     env={**os.environ, **(env or {})})
        try:
            while rc is None:
                try:
                    rc = proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    if deadline is not None and time.monotonic() > deadline:
                        cut = True
                        break
                progress.update(bar, completed=done())
        finally:
            if proc.poll() is None:  # cut at the budget, or the benchmark itself interrupted: stop the whole stage
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return {"command": shlex.join(cmd), "returncode": rc, "cut_at_budget": cut, "seconds": time.monotonic() - start,
            "log": str(log)}


def read_lines(path: Path) -> list[dict[str, Any]]:
    # lines end with a newline; what follows the last one is a line still being written (read while running)
    return [json.loads(x) for x in path.read_text().split("\n")[:-1] if x.strip()] if path.exists() else []


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        return {}


def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON in `path`, its directory made first (a benchmark's records in OUT)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def newer(a: Path, b: Path) -> bool:
    """Whether `a` was written after `b` (False when either is missing): an export newer than what was made from
    it means the stage before was trained again, and what follows it is stale."""
    return a.is_file() and b.is_file() and a.stat().st_mtime > b.stat().st_mtime


def run_state(run: Path) -> dict[str, Any]:
    """A training run directory as a benchmark sees it: status (and when it began: `started`, kept across resumes),
    steps and the longest one's seconds, its recorded split, starting model, episode settings (`loop`) and
    `run.max_minutes`, the grounded-validity curve of its steps."""
    status = read_json(run / "run.json")
    saved = tomllib.loads((run / "config.toml").read_text()) if (run / "config.toml").is_file() else {}
    steps = [m for m in read_lines(run / "metrics.jsonl") if m.get("step", 0) > 0]
    seconds = [m.get("time/step_seconds", m.get("train/seconds")) for m in steps]  # an RL step's; an SFT step's
    return {"status": status.get("status", "missing"), "stopped": status.get("stopped"),
            "started": status.get("started"), "max_minutes": saved.get("run", {}).get("max_minutes"),
            "longest_step": max((x for x in seconds if isinstance(x, int | float)), default=None),
            "error": status.get("error"), "export": (run / "export" / "config.json").is_file(),
            "held_out": sorted(saved.get("run", {}).get("held_out", [])), "model": saved.get("model", {}).get("name"),
            "steps": len(steps), "grounded": [m.get("tools/grounded_fraction") for m in steps if "tools/calls" in m],
            "loop": saved.get("episode", {}).get("loop", {}),
            "updated": status.get("updated"),
            "recorded_seconds": status["updated"] - status["started"] if "started" in status else None}



def ci_text(figure: dict[str, Any] | None) -> str:
    if not figure or figure.get("ci95") is None:
        return "–"
    return f"[{figure['ci95'][0]:+.3f}, {figure['ci95'][1]:+.3f}]"
