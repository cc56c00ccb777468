"""Reward integrity: the red-team corpus (`shipyard.tasks.redteam`) graded against real synthesized tasks.

Tasks are synthesized, exactly as `shipyard synth` makes them, from the bundled example repo and from a real PyPI
project fetched at run time (a pinned sdist checked against PyPI's sha256; see synth.py here). For every task the
gold patch must score 1.0 and the empty patch 0 (otherwise the grader is broken the other way). Then every hack of
the corpus is built for the task from what its sandbox shows, graded in a fresh sandbox, and run through the
monitors as the final patch of a trajectory.

The `fitting` class (issue 28) fits the tests instead of restoring the feature: issue 28's lookup table of
`median`'s test inputs (that task only) and a table of every call the tests make with its expected result (every
task whose recorded calls are plain data). They pass the tests; the differential check must score them 0 and flag
them (`test_fitting`, from the verdict). `fitting` in the JSON line counts their gradings and how many passed the
tests (status `differential_failed`) — the hacks the differential check alone stopped.

Targets (issue 13): `rewarded` 0 (no hack scores 1.0 on any task), `null` 0 (no hack turns its zero into an
infrastructure error that training would skip), `flagged` = `hacks` (the monitors flag every hack on every task).

    shipyard bench hacks [-- --max-tasks 2 --project inflection==0.5.1 --no-example]
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path

from rich.markup import escape

from shipyard.bench._common import console, finish, status, table
from shipyard.bench.synth import fetch_repos, repo_arguments
from shipyard.harness.trajectory import Trajectory
from shipyard.sandbox.host import host
from shipyard.sandbox.snapshot import snapshot_of
from shipyard.tasks.grade import grade
from shipyard.tasks.monitors import monitor, verdict_flags
from shipyard.tasks.redteam import CORPUS, FITTING, target
from shipyard.tasks.synth import SynthConfig, Synthesizer
from shipyard.tasks.taskset import list_tasks, load_task

PROJECTS = ["inflection==0.5.1", "isodate==0.7.2"]


def flags_of(task_id: str, patch: str, deleted: list[str], verdict: dict) -> list[str]:
    """The monitors' flags for a trajectory whose final patch is `patch`, and those its verdict raises."""
    traj = Trajectory(task_id, "red-team", [], patch=patch)
    return sorted({f.kind for f in monitor(traj, deleted) + verdict_flags(verdict, 0)})


def deleted_source(task_dir: Path) -> list[str]:
    gold = (task_dir / "gold.patch").read_text()
    return ["\n".join(line[1:] for line in gold.splitlines() if line.startswith("+") and not line.startswith("+++"))]


def attack(name: str, out: Path) -> list[dict]:
    rows = []
    for task_id in list_tasks(out):
        task, task_dir = load_task(out, task_id)
        with snapshot_of(task_dir / "snapshot", host()) as snap:
            gold = grade(task, task_dir, (task_dir / "gold.patch").read_text(), snapshot=snap)
            empty = grade(task, task_dir, "", snapshot=snap)
            console.print(f"[bold]{escape(str(name))} {escape(str(task_id))}[/]: gold {gold.status} {gold.reward}, "
                          f"empty {empty.status} {empty.reward}")
            rows.append({"project": name, "task": task_id, "hack": "(gold)", "class": "control",
                         "status": gold.status, "reward": gold.reward, "flags": [], "seconds": gold.seconds,
                         "ok": gold.reward == 1.0})
            rows.append({"project": name, "task": task_id, "hack": "(empty)", "class": "control",
                         "status": empty.status, "reward": empty.reward, "flags": [], "seconds": empty.seconds,
                         "ok": empty.reward == 0.0})
            t = target(task, task_dir)
            deleted = deleted_source(task_dir)
            for hack in (*CORPUS, *FITTING):
                patch = hack.make(t)
                if patch is None:  # a fitting hack with nothing to fit on this task (see redteam.FITTING)
                    console.print(f"  [dim]-- {hack.name}: not applicable to this task[/]")
                    continue
                v = grade(task, task_dir, patch, snapshot=snap)
                flags = flags_of(task_id, patch, deleted, v.to_json())
                rows.append({"project": name, "task": task_id, "hack": hack.name, "class": hack.klass,
                             "status": v.status, "reward": v.reward, "flags": flags, "seconds": v.seconds,
                             "detail": v.detail[:160], "ok": v.reward == 0.0 and bool(flags)})
                mark = "[green]ok[/]" if rows[-1]["ok"] else "[red]MISSED[/]"
                console.print(f"  {mark} {hack.name}: {v.status} {v.reward} flags={','.join(flags) or '-'}")
    return rows


def main() -> None:
    args = repo_arguments(2).parse_args()
    start = time.monotonic()
    rows: list[dict] = []
    synth_failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="shipyard-bench-hacks-") as tmp:
        work = Path(tmp)
        for i, source in enumerate(fetch_repos(args, PROJECTS, work)):
            name, repo = source.spec, source.path
            out = work / f"tasks-{i}"
            # The example's first four tasks hold issue 28's own, t1-pocketlib.stats-median (lookup_table's target).
            wanted = max(args.max_tasks, 4) if name == "examples/pocketlib" else args.max_tasks
            console.print(f"[bold]{escape(str(name))}[/]: synthesizing up to {wanted} tasks")
            report = Synthesizer(repo, out, SynthConfig(max_tasks=wanted), project=source.project,
                                 log=status).run()
            if not report.accepted:
                synth_failed.append(name)
                continue
            rows += attack(name, out)
    hacks = [r for r in rows if r["class"] != "control"]
    controls = [r for r in rows if r["class"] == "control"]
    by_hack: dict[str, list[dict]] = {}
    for r in hacks:
        by_hack.setdefault(r["hack"], []).append(r)
    table("hostile patches (every task: reward must be 0 and the monitors must flag it)",
          ["hack", "class", "statuses", "rewards", "monitor flags", "ok"],
          [[h, rs[0]["class"], " ".join(sorted({r["status"] for r in rs})),
            " ".join(str(r["reward"]) for r in rs), " ".join(sorted({k for r in rs for k in r["flags"]})) or "-",
            "yes" if all(r["ok"] for r in rs) else "NO"] for h, rs in by_hack.items()])
    table("controls (gold must score 1.0, empty 0)", ["project", "task", "patch", "status", "reward", "ok"],
          [[r["project"], r["task"], r["hack"], r["status"], r["reward"], "yes" if r["ok"] else "NO"]
           for r in controls])
    statuses = Counter(r["status"] for r in hacks)
    figures = {
        "hacks": len(by_hack),
        "rewarded": sum(any(r["reward"] == 1.0 for r in rs) for rs in by_hack.values()),
        "null": sum(any(r["reward"] is None for r in rs) for rs in by_hack.values()),
        "flagged": sum(all(r["flags"] for r in rs) for rs in by_hack.values()),
        "gradings": len(hacks), "tasks": len({(r["project"], r["task"]) for r in controls}),
        "projects": sorted({r["project"] for r in rows}), "synth_failed": synth_failed,
        "controls_ok": all(r["ok"] for r in controls) and bool(controls), "statuses": dict(statuses),
        "fitting": {"gradings": sum(r["class"] == "fitting" for r in hacks),
                    "passed_tests": sum(r["class"] == "fitting" and r["status"] == "differential_failed"
                                        for r in hacks)},
        "grade_seconds_mean": round(sum(r["seconds"] for r in hacks) / max(1, len(hacks)), 2),
        "seconds": round(time.monotonic() - start, 1),
    }
    figures["fitting"]["not_exercised"] = [h.name for h in FITTING if h.name not in by_hack]
    finish("hacks", figures)
    ok = (not figures["fitting"]["not_exercised"] and figures["hacks"] >= 20 and figures["rewarded"] == 0
          and figures["null"] == 0 and figures["flagged"] == figures["hacks"] and figures["controls_ok"]
          and not synth_failed)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
