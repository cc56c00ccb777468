"""Feature-deletion task synthesis on the example repo and on real projects fetched from PyPI at run time.

For each project: `Synthesizer(...).run()` exactly as `shipyard synth` does it (environment, 3 suite runs with
per-test coverage, candidates per tier, every validation step), then yield (accepted / tried), rejection reasons
and validated tasks per CPU-hour (user + system time of this process and every sandboxed child it waited for).
Targets (issue 4): yield >= 40 %, >= 30 validated tasks per CPU-hour.

The real projects are source distributions pinned by version and checked against the sha256 PyPI publishes; they
are downloaded into a temporary directory, never committed. They were chosen as small pure-Python libraries whose
sdists ship their pytest suites: cachetools (a `tests/` package whose test methods come from mixins) and parse (one
module of ~1,000 lines, its tests import names from it).

    shipyard bench synth [-- --max-tasks 20 --project cachetools==8.0.1 --project parse==1.22.4 --no-example]
"""

from __future__ import annotations

import argparse
import hashlib
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

import httpx

from shipyard.bench._common import console, finish, table
from shipyard.rollout.demo import EXAMPLE_REPO
from shipyard.tasks.synth import SynthConfig, Synthesizer

PROJECTS = ["cachetools==8.0.1", "parse==1.22.4"]


def fetch_sdist(spec: str, index: str, dest: Path) -> Path:
    """Download `name==version`'s sdist from the index's JSON API, verify its sha256, unpack it; its root dir."""
    name, _, version = spec.partition("==")
    if not version:
        raise SystemExit(f"--project {spec!r}: pin a version, as in cachetools==8.0.1")
    url = f"{index.rstrip('/')}/pypi/{name}/json"  # (some mirrors do not serve the per-version document)
    with httpx.Client(timeout=120, follow_redirects=True) as client:
        response = client.get(url)
        if response.status_code == 404:
            raise SystemExit(f"{name}: not on {index}")
        response.raise_for_status()
        releases = response.json()["releases"]
        if version not in releases:
            raise SystemExit(f"{spec}: no such release on {index}; latest: {response.json()['info']['version']}")
        sdists = [u for u in releases[version] if u["packagetype"] == "sdist"]
        if not sdists:
            raise SystemExit(f"{spec} has no source distribution on {index}")
        info = sdists[0]
        # Mirrors answer with URLs relative to the JSON document.
        data = client.get(httpx.URL(url).join(info["url"])).raise_for_status().content
    if hashlib.sha256(data).hexdigest() != info["digests"]["sha256"]:
        raise SystemExit(f"{info['filename']}: sha256 does not match the index's; refusing to use it")
    archive = dest / info["filename"]
    archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        tar.extractall(dest / "src", filter="data")
    (root,) = (dest / "src").iterdir()
    return root


def synthesize(name: str, repo: Path, out: Path, config: SynthConfig) -> dict:
    console.print(f"[bold]{name}[/bold]: synthesizing up to {config.max_tasks} tasks from {repo}")
    report = Synthesizer(repo, out, config, log=lambda line: console.print(f"  [dim]{line}[/dim]")).run()
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
    ap.add_argument("--index", default="https://pypi.org", help="index serving PyPI's JSON API")
    ap.add_argument("--no-example", action="store_true", help="skip the bundled example repo")
    return ap


def fetch_repos(args: argparse.Namespace, default: list[str], work: Path) -> dict[str, Path]:
    """name → source tree: the example repo unless --no-example, then each --project (or `default`) sdist, all
    downloaded before any work so that a bad spec fails first."""
    repos = {} if args.no_example else {"examples/pocketlib": EXAMPLE_REPO}
    for spec in args.project or default:
        (work / spec).mkdir()
        repos[spec] = fetch_sdist(spec, args.index, work / spec)
    return repos


def main() -> None:
    args = repo_arguments(20).parse_args()
    config = SynthConfig(max_tasks=args.max_tasks)
    results = []
    with tempfile.TemporaryDirectory(prefix="shipyard-bench-synth-") as tmp:
        work = Path(tmp)
        for i, (name, repo) in enumerate(fetch_repos(args, PROJECTS, work).items()):
            results.append(synthesize(name, repo, work / f"out-{i}", config))
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
