"""Feature-deletion task synthesis on the example repo and on real projects fetched from PyPI at run time.

For each project: `Synthesizer(...).run()` exactly as `shipyard synth` does it (environment, 3 suite runs with
per-test coverage, candidates per tier, every validation step), then yield (accepted / tried), rejection reasons
and validated tasks per CPU-hour (user + system time of this process and every sandboxed child it waited for).
Targets (issue 4): yield >= 40 %, >= 30 validated tasks per CPU-hour.

The real projects are source distributions pinned by version and checked against the sha256 the index publishes,
fetched as `shipyard synth` fetches them (`shipyard.tasks.sources`) into a temporary directory, never committed.
They were chosen as small pure-Python libraries whose sdists ship their pytest suites: cachetools (a `tests/`
package whose test methods come from mixins) and parse (one module of ~1,000 lines, its tests import names from it).

    shipyard bench synth [-- --max-tasks 20 --project cachetools==8.0.1 --project parse==1.22.4 --no-example]
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

from rich.markup import escape

from shipyard.bench._common import console, finish, status, table
from shipyard.rollout.demo import EXAMPLE_REPO
from shipyard.tasks.sources import Source, resolve
from shipyard.tasks.synth import SynthConfig, Synthesizer

PROJECTS = ["cachetools==8.0.1", "parse==1.22.4"]


def synthesize(source: Source, out: Path, config: SynthConfig) -> dict:
    name = source.spec
    console.print(f"[bold]{escape(str(name))}[/bold]: synthesizing up to {config.max_tasks} tasks from "
                  f"{escape(str(source.path))}")
    report = Synthesizer(source.path, out, config, log=status,
                         project=source.project).run()
    tiers = Counter(int(task_id[1]) for task_id in report.accepted)
    return {"project": name, "stable_tests": report.stable_tests, "excluded_tests": len(report.excluded_tests),
            "tried": report.tried, "accepted": len(report.accepted), "yield": round(report.yield_, 3),
            "tiers": {f"T{t}": tiers[t] for t in sorted(tiers)}, "rejections": dict(report.rejections),
            "seconds": report.seconds, "cpu_seconds": report.cpu_seconds,
            "tasks_per_cpu_hour": round(report.tasks_per_cpu_hour, 1), "differential": report.differential}


def repo_arguments(max_tasks: int) -> argparse.ArgumentParser:
    """The options of a benchmark over the example repo and PyPI projects (see `fetch_repos`)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tasks", type=int, default=max_tasks, help="tasks to accept per project")
    ap.add_argument("--project", action="append", help="name==version of a PyPI sdist (repeatable)")
    ap.add_argument("--index", default=None, help="the package index's simple API (default: pip's, else PyPI)")
    ap.add_argument("--no-example", action="store_true", help="skip the bundled example repo")
    return ap


def fetch_repos(args: argparse.Namespace, default: list[str], work: Path) -> list[Source]:
    """The example repo unless --no-example, then each --project (or `default`) sdist, all fetched before any work
    so that a bad spec fails first (`shipyard.tasks.sources.resolve`, as `shipyard synth` fetches them)."""
    specs = [*([] if args.no_example else [str(EXAMPLE_REPO)]), *(args.project or default)]
    sources = resolve(specs, work, args.index, SynthConfig().cache)
    return [replace(s, spec="examples/pocketlib") if s.path == EXAMPLE_REPO.resolve() else s for s in sources]


def main() -> None:
    args = repo_arguments(20).parse_args()
    config = SynthConfig(max_tasks=args.max_tasks)
    results = []
    with tempfile.TemporaryDirectory(prefix="shipyard-bench-synth-") as tmp:
        work = Path(tmp)
        for i, source in enumerate(fetch_repos(args, PROJECTS, work)):
            results.append(synthesize(source, work / f"out-{i}", config))
    table("feature-deletion synthesis (targets: yield >= 40 %, >= 30 tasks per CPU-hour)",
          ["project", "stable tests", "tried", "accepted", "tiers", "yield", "wall s", "CPU s", "tasks/CPU-h"],
          [[r["project"], r["stable_tests"], r["tried"], r["accepted"],
            " ".join(f"{k}:{v}" for k, v in r["tiers"].items()), f"{r['yield']:.0%}", r["seconds"],
            r["cpu_seconds"], r["tasks_per_cpu_hour"]] for r in results])
    table("rejection reasons", ["project", "reason", "count"],
          [[r["project"], reason, n] for r in results for reason, n in sorted(r["rejections"].items())])
    coverage = [[r["project"], tier, d["tasks"], d["with_cases"], d["cases"],
                 "; ".join(f"{why} ({n})" for why, n in d["why_none"].items()) or "-"]
                for r in results for tier, d in sorted(r["differential"].items())]
    table("differential checks (issue 28: cases on >= 70 % of T1 tasks)",
          ["project", "tier", "tasks", "with cases", "cases", "why none"], coverage)
    t1 = [r["differential"]["T1"] for r in results if "T1" in r["differential"]]
    t1_share = round(sum(d["with_cases"] for d in t1) / max(1, sum(d["tasks"] for d in t1)), 3)
    finish("synth", {"max_tasks": args.max_tasks, "projects": results, "differential_t1_share": t1_share,
                     "targets_met": all(r["yield"] >= 0.4 and r["tasks_per_cpu_hour"] >= 30 for r in results),
                     "differential_target_met": t1_share >= 0.7})


if __name__ == "__main__":
    main()
