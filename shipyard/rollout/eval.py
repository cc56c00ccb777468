"""`shipyard eval`: rollouts without training on held-out tasks, summarised as pass@k and effort, per task and overall.

**What is measured.** Each task is run `samples` times (one group; each sample its own seed, `rollout_seed`) by the
shared scheduler (`Scheduler.evaluate`), so eval runs episodes exactly as training does: same harness, same
sandboxes, same grader. A rollout *passes* when the grader's reward is 1.

**pass@k, unbiased** (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv 2107.03374, §2.1):
with n scored samples of a task of which c pass, the probability that at least one of k samples drawn without
replacement from those n passes is

    pass@k = 1 − C(n−c, k) / C(n, k)  =  1 − ∏_{i=n−c+1}^{n} (1 − k/i)

The product form never builds the binomials (C(200, 100) has 59 digits), and each factor is in [0, 1], so it is
numerically stable. When n − c < k every draw of k holds a pass: pass@k = 1. pass@k needs k ≤ n; a task with fewer
scored samples has no pass@k (null), and the overall pass@k is the mean over the tasks that have one (their count is
reported with it). pass@1 is c/n.

**Infrastructure failures are not zeros.** A rollout whose environment, sandbox, engine or grader infrastructure
failed (`infra_error`) or that ran out of time (`cancelled`) carries no reward: the scheduler retries it, and if it
still fails it is *masked* — left out of pass@k, with n reduced — and counted by cause. A model that solves nothing
is a successful eval with pass@1 = 0; an eval in which nothing could be scored is a failed run (`EvalFailed`).

**Effort** (tokens sampled, turns, tool calls, parallel width — the mean number of calls per turn that made calls —,
seconds per rollout) is averaged over scored rollouts, so it is comparable with the pass rates beside it; totals
count every rollout. Monitor flags (`shipyard.tasks.monitors`) are counted per task, by kind. **Grounded tool-call
validity** (`shipyard.harness.validity`: the call ran, in the wire format, with no placeholder or trivial argument)
is pooled over the calls of scored rollouts: `validity.grounded_fraction` is grounded calls / calls, so a rollout
that sprays calls weighs what it did; `reward_mean` is the grader's mean reward over scored rollouts.

Results are one JSON document (`SCHEMA`) holding the configuration, `overall`, `tasks` and one metrics line per
rollout, and a markdown table (`markdown`). `compare` reads two such files and reports B − A per task and overall,
the overall recomputed over the tasks both files scored (a mean over different task sets is not comparable), and
lists the tasks only one of them holds.

**Intervals** (`bootstrap_mean`, `paired_difference`): the percentile bootstrap (Efron & Tibshirani 1993, "An
Introduction to the Bootstrap", ch. 13) over *tasks*, the unit that is sampled from a population of tasks: draw n
of the n per-task values with replacement, take their mean, repeat R times (seeded), and report the 2.5 % and
97.5 % quantiles of the R means — the draws of ranks ⌊0.025 R⌋ and ⌈0.975 R⌉ − 1, counted from 0 in sorted order.
Two models evaluated on the same tasks are *paired*: the interval of their difference resamples tasks and takes,
for each drawn task, B's success rate minus A's on that same task, so the task-to-task spread that both share
(an easy task is easy for both) cancels instead of widening the interval. Identical results give mean 0 and
[0, 0]; a constant shift c on every task gives [c, c]. The samples within a task are not resampled: a task's value
is its success rate over them, and their sampling noise is part of the task-to-task spread the interval measures.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from shipyard.errors import FileFormatError, UsageError
from shipyard.harness.trajectory import CallRecord
from shipyard.harness.validity import ValidityChecker, ValidityStats
from shipyard.rollout.record import Rollout

SCHEMA = "shipyard.eval/1"
EFFORT = ("sampled_tokens", "turns", "tool_calls", "parallel_width", "seconds")  # means over scored rollouts
MAX_RESULTS_BYTES = 256 << 20
CAUSE_CHARS = 120
EXAMPLE_CHARS = 300
IDENTIFIER = re.compile(r"[A-Za-z_][\w.]*")
# calls_by_tool's keys for calls that ran no tool: a name not offered, JSON that could not be read, a turn that ended
# inside its call (its token budget ran out)
UNKNOWN_TOOL, UNPARSED_CALL, CUT_CALL = "(not a tool)", "(unparsed)", "(cut off)"


class EvalFailed(RuntimeError):
    """The eval itself failed: no rollout could be scored (every one hit an infrastructure failure or its budget)."""


class ResultsFileError(FileFormatError):
    """A file given to `--compare` is not an eval result; the message names the file and the problem."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a task with `n` scored samples, `c` of them passing (Chen et al. 2021, product form)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def default_ks(samples: int) -> list[int]:
    """1, 2, 4, … up to `samples`, and `samples` itself."""
    ks = [k for k in (2**j for j in range(samples.bit_length())) if k <= samples]
    return sorted(set(ks) | {samples}) if samples >= 1 else []


def passed(rollout: Rollout) -> bool:
    return rollout.reward is not None and rollout.reward >= 1.0


def _effort(rollout: Rollout) -> dict[str, float]:
    summary = rollout.trajectory.summary() if rollout.trajectory else {}
    seconds = rollout.timings.get("total")
    if seconds is None:
        seconds = rollout.trajectory.seconds if rollout.trajectory else 0.0
    return {"sampled_tokens": float(summary.get("sampled_tokens", 0)), "turns": float(summary.get("turns", 0)),
            "tool_calls": float(summary.get("tool_calls", 0)),
            "parallel_width": float(summary.get("mean_parallel_width", 0.0)), "seconds": float(seconds)}


@cache
def _checker() -> ValidityChecker:
    return ValidityChecker()


def validity(rollouts: Iterable[Rollout]) -> ValidityStats:
    """Grounded tool-call validity pooled over the calls of `rollouts` (default tool set)."""
    total = ValidityStats()
    for r in rollouts:
        if r.trajectory is not None:
            total = total + _checker().trajectory(r.trajectory)
    return total


def cause_kind(rollout: Rollout) -> str:
    """What a masked rollout's failure counts as: its stage and exception (`"workspace: EnvServerUnreachable"`, from
    causes written `"<stage>: <exception>: <message>"`), or the stage alone; never the message, which names sandboxes
    and ports, so that one failure mode is one count. `cancelled` for a rollout whose budget ran out."""
    if rollout.status == "cancelled":
        return "cancelled"
    lines = (rollout.infra_cause or "").strip().splitlines()
    parts = [p.strip() for p in lines[0].split(":", 2)] if lines else []
    kind = parts[:2] if len(parts) > 1 and IDENTIFIER.fullmatch(parts[1]) else parts[:1]
    return ": ".join(kind)[:CAUSE_CHARS] or "unknown cause"


@dataclass
class Summary:
    """pass@k and effort of a set of rollouts: one task's group, or (with `pass_at` averaged over tasks) overall."""

    rollouts: int = 0  # rollouts that ended (after retries)
    scored: int = 0  # n: rollouts with a reward
    passed: int = 0  # c
    pass_at: dict[str, float | None] = field(default_factory=dict)  # "k" -> pass@k (null: fewer than k scored)
    masked: int = 0  # infra_error or cancelled after retries: left out of pass@k
    infra: dict[str, int] = field(default_factory=dict)  # masked rollouts by `cause_kind`
    infra_examples: dict[str, str] = field(default_factory=dict)  # the first full cause of each kind
    statuses: dict[str, int] = field(default_factory=dict)
    stop_reasons: dict[str, int] = field(default_factory=dict)
    monitor_flags: dict[str, int] = field(default_factory=dict)  # by kind
    flagged_rollouts: int = 0
    mean: dict[str, float] = field(default_factory=dict)  # EFFORT, over scored rollouts
    reward_mean: float | None = None  # the grader's reward, over scored rollouts
    validity: dict[str, Any] = field(default_factory=dict)  # grounded tool-call validity over scored rollouts' calls
    total: dict[str, float] = field(default_factory=dict)  # EFFORT sums over every rollout (parallel width: none)
    calls_by_tool: dict[str, int] = field(default_factory=dict)  # scored rollouts' calls; UNKNOWN_TOOL: not offered
    fail_to_pass: dict[str, Any] = field(default_factory=dict)  # progress short of a pass (`_progress`)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _count(summary: Summary, rollouts: list[Rollout]) -> None:
    statuses, stops, flags, infra = Counter(), Counter(), Counter(), Counter()
    scored_effort, all_effort, scored = [], [], []
    for r in rollouts:
        statuses[r.status] += 1
        stops[r.stop_reason or "none"] += 1
        flags.update(str(f.get("kind", "unknown")) for f in r.monitor_flags)
        summary.flagged_rollouts += bool(r.monitor_flags)
        effort = _effort(r)
        all_effort.append(effort)
        if r.masked:
            kind = cause_kind(r)
            infra[kind] += 1
            summary.infra_examples.setdefault(kind, (r.infra_cause or r.status).strip()[:EXAMPLE_CHARS])
        else:
            scored_effort.append(effort)
            scored.append(r)
    summary.rollouts = len(rollouts)
    summary.scored = len(scored_effort)
    summary.masked = summary.rollouts - summary.scored
    summary.passed = sum(passed(r) for r in rollouts)
    summary.statuses, summary.stop_reasons = dict(sorted(statuses.items())), dict(sorted(stops.items()))
    summary.monitor_flags, summary.infra = dict(sorted(flags.items())), dict(infra.most_common())
    summary.mean = {k: (sum(e[k] for e in scored_effort) / len(scored_effort) if scored_effort else 0.0)
                    for k in EFFORT}
    summary.total = {k: sum(e[k] for e in all_effort) for k in EFFORT if k != "parallel_width"}
    summary.reward_mean = sum(r.reward for r in scored) / len(scored) if scored else None
    summary.calls_by_tool = _calls_by_tool(scored)
    summary.fail_to_pass = _progress(scored)
    stats = validity(scored)
    summary.validity = {"calls": stats.calls, "grounded": stats.grounded, "placeholder": stats.placeholder,
                        "untagged": stats.untagged, "grounded_fraction": stats.grounded_fraction if stats.calls
                        else None, "problems": dict(sorted(stats.problems.items()))}


def _calls_by_tool(rollouts: list[Rollout]) -> dict[str, int]:
    """Calls by tool name, most called first. A call that ran no tool is counted by why, so the keys stay few:
    CUT_CALL (the turn ended inside it), UNPARSED_CALL (no readable name: invalid JSON), UNKNOWN_TOOL (a name the
    episode did not offer: the model calling the function it was asked to write, say)."""
    known = _checker().tools
    counts = Counter(_call_key(c, known) for r in rollouts if r.trajectory is not None
                     for turn in r.trajectory.turns for c in turn.calls)
    return dict(counts.most_common())


def _call_key(call: CallRecord, known: Mapping[str, Any]) -> str:
    if call.error_kind == "truncated":
        return CUT_CALL
    if call.name is None:
        return UNPARSED_CALL
    return UNKNOWN_TOOL if call.error_kind == "unknown_tool" or call.name not in known else call.name


def _progress(rollouts: list[Rollout]) -> dict[str, Any]:
    """How far scored rollouts got on their task's failing tests, the signal that moves before pass@1 does:
    `mean`, the mean over rollouts of the fraction of fail-to-pass tests that passed (0 for a patch that was not
    graded), and `some`, the rollouts that made at least one pass without solving the task."""
    fractions, some = [], 0
    for r in rollouts:
        f2p = (r.verdict or {}).get("fail_to_pass") or {}
        made, total = f2p.get("passed", 0), f2p.get("total", 0)
        fractions.append(made / total if total else 0.0)
        some += made > 0 and not passed(r)
    return {"mean": sum(fractions) / len(fractions) if fractions else None, "some": some}


def summarize_task(rollouts: list[Rollout], ks: Iterable[int]) -> Summary:
    summary = Summary()
    _count(summary, rollouts)
    summary.pass_at = {str(k): pass_at_k(summary.scored, summary.passed, k) if k <= summary.scored else None
                       for k in ks}
    return summary


def summarize_overall(groups: Mapping[str, list[Rollout]], tasks: Mapping[str, Summary], ks: Iterable[int]) \
        -> tuple[Summary, dict[str, int]]:
    """The pooled counts of every rollout, pass@k as the mean over tasks that have it, and how many tasks that is."""
    summary = Summary()
    _count(summary, [r for group in groups.values() for r in group])
    tasks_at = {}
    for k in ks:
        values = [s.pass_at[str(k)] for s in tasks.values() if s.pass_at.get(str(k)) is not None]
        summary.pass_at[str(k)] = sum(values) / len(values) if values else None
        tasks_at[str(k)] = len(values)
    return summary, tasks_at


def results(groups: Mapping[str, list[Rollout]], ks: list[int], *, config: Mapping[str, Any], wall_seconds: float,
            scheduler_stats: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The results document of an eval: configuration, overall, per task, and one metrics line per rollout."""
    tasks = {task: summarize_task(group, ks) for task, group in sorted(groups.items())}
    overall, tasks_at = summarize_overall(groups, tasks, ks)
    unscored = [task for task, s in tasks.items() if s.scored == 0]
    return {"schema": SCHEMA, "config": dict(config), "ks": list(ks), "wall_seconds": round(wall_seconds, 3),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "overall": {**overall.to_json(), "tasks": len(tasks), "tasks_scored": len(tasks) - len(unscored),
                        "tasks_unscored": unscored, "tasks_at": tasks_at,
                        "rollouts_per_hour": round(overall.rollouts * 3600 / wall_seconds, 2) if wall_seconds
                        else None},
            "tasks": {task: s.to_json() for task, s in tasks.items()},
            "scheduler": dict(scheduler_stats or {}),
            "rollouts": [r.metrics() for group in groups.values() for r in group]}


def check_scored(doc: Mapping[str, Any]) -> None:
    """Raise `EvalFailed` when the eval could not score a single rollout (the run failed, not the model)."""
    overall = doc["overall"]
    if overall["rollouts"] == 0:
        raise EvalFailed("the eval ran no rollout")
    if overall["scored"] == 0:
        causes = "; ".join(f"{n}× {cause}" for cause, n in list(overall["infra"].items())[:3])
        first = next(iter(overall["infra_examples"].values()), "")
        causes += f"; first: {first}" if first else ""
        raise EvalFailed(f"no rollout could be scored: all {overall['rollouts']} ended without a reward ({causes}). "
                         "This is a failure of the infrastructure (engine, sandboxes or environment server), not a "
                         "score of the model")


# Reports -----------------------------------------------------------------------------------------------------------
def _header(head: list[str]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if digits else f"{value:,.0f}"


def _row(name: str, s: Mapping[str, Any], ks: list[int]) -> str:
    mean = s["mean"]
    flags = sum(s["monitor_flags"].values())
    return "| " + " | ".join([name, *(_fmt(s["pass_at"].get(str(k))) for k in ks), f"{s['passed']}/{s['scored']}",
                              _fmt(mean["sampled_tokens"], 0), _fmt(mean["turns"], 1), _fmt(mean["tool_calls"], 1),
                              _fmt(mean["parallel_width"], 2), _fmt(s.get("validity", {}).get("grounded_fraction")),
                              _fmt(mean["seconds"], 1), str(s["masked"]), str(flags)]) + " |"


def markdown(doc: Mapping[str, Any]) -> str:
    """The results as a markdown table: one row per task, then the overall row (pass@k: mean over tasks)."""
    ks = list(doc["ks"])
    head = ["task", *(f"pass@{k}" for k in ks), "passed/scored", "tokens", "turns", "tool calls", "width",
            "grounded", "seconds", "infra", "flags"]
    lines = _header(head)
    lines += [_row(task, s, ks) for task, s in doc["tasks"].items()]
    lines.append(_row("**overall**", doc["overall"], ks))
    overall = doc["overall"]
    notes = [f"{overall['tasks']} tasks, {overall['rollouts']} rollouts in {doc['wall_seconds']:.1f} s; effort columns "
             "are means over scored rollouts; grounded: grounded tool calls / calls; infra: rollouts masked (left out "
             "of pass@k) after retries"]
    f2p, calls = overall.get("fail_to_pass") or {}, overall.get("calls_by_tool") or {}
    if f2p.get("mean") is not None:
        notes.append(f"failing tests made to pass: {f2p['mean']:.3f} of each task's, on average; {f2p['some']} "
                     f"rollouts made some pass without solving their task")
    if calls:
        notes.append("calls by tool: " + ", ".join(f"{name} {n}" for name, n in calls.items()))
    if overall["infra"]:
        notes.append("infra causes: " + "; ".join(f"{n}× {c}" for c, n in overall["infra"].items()))
    if overall["tasks_unscored"]:
        notes.append(f"not scored (every rollout masked): {', '.join(overall['tasks_unscored'])}")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


# Comparing two result files ------------------------------------------------------------------------------------------
def load_results(path: str | Path) -> dict[str, Any]:
    """An eval result file, checked enough that `compare` cannot fail halfway; `ResultsFileError` otherwise."""
    path = Path(path)

    def bad(why: str) -> ResultsFileError:
        return ResultsFileError(f"{path} is not a shipyard eval result: {why}")

    if not path.is_file():
        raise bad("no such file")
    if path.stat().st_size > MAX_RESULTS_BYTES:
        raise bad(f"larger than {MAX_RESULTS_BYTES >> 20} MiB")
    try:
        doc = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise bad(f"not JSON ({str(e).splitlines()[0][:100]})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise bad(f"its 'schema' is not {SCHEMA!r} (write one with `shipyard eval --out FILE`)")
    ks = doc.get("ks")
    if not isinstance(ks, list) or not all(isinstance(k, int) and k >= 1 for k in ks):
        raise bad("'ks' is not a list of positive integers")
    for name, summary in [("overall", doc.get("overall")), *((f"task {t}", s) for t, s in
                                                             (doc.get("tasks") or {}).items())]:
        if not isinstance(summary, dict):
            raise bad(f"{name} is not an object")
        if not isinstance(summary.get("pass_at"), dict) or not isinstance(summary.get("mean"), dict):
            raise bad(f"{name} has no 'pass_at' or 'mean' object")
        for key in ("scored", "masked"):
            if not isinstance(summary.get(key), int):
                raise bad(f"{name}: '{key}' is not an integer")
        for key, value in [*summary["pass_at"].items(), *summary["mean"].items()]:
            if value is not None and not isinstance(value, int | float):
                raise bad(f"{name}: '{key}' is not a number")
        if not isinstance(summary.get("monitor_flags"), dict):
            raise bad(f"{name}: 'monitor_flags' is not an object")
    if not isinstance(doc.get("tasks"), dict):
        raise bad("'tasks' is not an object")
    return doc


def save_results(doc: Mapping[str, Any], path: str | Path) -> Path:
    """Write a results (or comparison) document as the JSON file `load_results` reads; its folder is made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def write_outputs(doc: Mapping[str, Any], table: str, json_path: Path | None, markdown_path: Path | None) -> None:
    """`shipyard eval --out/--markdown`: the results document as JSON and its markdown table, where asked."""
    if json_path is not None:
        save_results(doc, json_path)
    if markdown_path is not None:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(table)


def _metrics(s: Mapping[str, Any], ks: list[int]) -> dict[str, float | None]:
    values: dict[str, float | None] = {f"pass@{k}": s["pass_at"].get(str(k)) for k in ks}
    values.update({k: s["mean"].get(k) for k in EFFORT})
    values["reward_mean"] = s.get("reward_mean")  # absent from results written before these fields existed
    values["grounded_fraction"] = s.get("validity", {}).get("grounded_fraction")
    values["masked"] = s["masked"]
    values["monitor_flags"] = sum(v for v in s["monitor_flags"].values() if isinstance(v, int | float))
    return values


def _delta(a: float | None, b: float | None) -> dict[str, float | None]:
    return {"a": a, "b": b, "delta": None if a is None or b is None else b - a}


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """B − A per task both files hold and overall over those tasks, with the tasks only one of them holds."""
    ks = [k for k in a["ks"] if k in b["ks"]]
    common = [t for t in a["tasks"] if t in b["tasks"]]
    tasks = {}
    for t in common:
        ma, mb = _metrics(a["tasks"][t], ks), _metrics(b["tasks"][t], ks)
        tasks[t] = {name: _delta(ma[name], mb[name]) for name in ma}
    overall = {}
    for name in [*(f"pass@{k}" for k in ks), *EFFORT, "reward_mean", "grounded_fraction", "masked", "monitor_flags"]:
        pairs = [(v["a"], v["b"]) for v in (tasks[t][name] for t in common)
                 if v["a"] is not None and v["b"] is not None]
        summed = name in ("masked", "monitor_flags")  # counts add up; rates and effort are means over tasks
        sides = [sum(p[i] for p in pairs) / (1 if summed else len(pairs)) for i in (0, 1)] if pairs else [None, None]
        overall[name] = {**_delta(*sides), "tasks": len(pairs)}
    return {"schema": SCHEMA.replace("eval/", "eval-compare/"), "ks": ks, "common_tasks": len(common),
            "only_a": sorted(t for t in a["tasks"] if t not in b["tasks"]),
            "only_b": sorted(t for t in b["tasks"] if t not in a["tasks"]),
            "a": {"model": a.get("config", {}).get("model"), "overall": {f"pass@{k}": a["overall"]["pass_at"].get(
                str(k)) for k in ks}},
            "b": {"model": b.get("config", {}).get("model"), "overall": {f"pass@{k}": b["overall"]["pass_at"].get(
                str(k)) for k in ks}},
            "overall": overall, "tasks": tasks}


BOOTSTRAP_RESAMPLES = 2000


def bootstrap_mean(values: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """The mean of `values` and its percentile bootstrap 95 % interval (module docstring, "Intervals"):
    `{"mean", "ci95": [lo, hi], "tasks": n}`; mean and interval null when there is no value."""
    n = len(values)
    if n == 0:
        return {"mean": None, "ci95": None, "tasks": 0}
    if resamples < 1:
        raise UsageError(f"a bootstrap needs at least 1 resample, got {resamples}")
    rng = random.Random(seed)
    draws = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    lo, hi = draws[math.floor(0.025 * resamples)], draws[max(math.ceil(0.975 * resamples) - 1, 0)]
    return {"mean": sum(values) / n, "ci95": [lo, hi], "tasks": n}


def paired_difference(a: Mapping[str, float | None], b: Mapping[str, float | None], *,
                      resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """B − A over the tasks both score (task → success rate; None: not scored), with the paired bootstrap 95 %
    interval (tasks resampled, each drawn task contributing b[t] − a[t]); `bootstrap_mean`'s document."""
    common = sorted(t for t in a if t in b and a[t] is not None and b[t] is not None)
    return bootstrap_mean([b[t] - a[t] for t in common], resamples=resamples, seed=seed)


def task_rates(doc: Mapping[str, Any], k: int = 1) -> dict[str, float | None]:
    """Task → pass@k of a results document (pass@1: the task's success rate over its scored samples)."""
    return {task: s["pass_at"].get(str(k)) for task, s in doc["tasks"].items()}


def _signed(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:+.{digits}f}"


def compare_markdown(doc: Mapping[str, Any]) -> str:
    ks = doc["ks"]
    names = [*(f"pass@{k}" for k in ks), "reward_mean", "grounded_fraction", "sampled_tokens", "turns", "tool_calls",
             "seconds", "masked"]
    digits = {"sampled_tokens": 0, "turns": 1, "tool_calls": 1, "seconds": 1, "masked": 0}
    head = ["task", *(f"{n} A → B (Δ)" for n in names)]
    lines = _header(head)

    def row(name: str, values: Mapping[str, Any]) -> str:
        cells = []
        for n in names:
            v, d = values[n], digits.get(n, 3)
            cells.append(f"{_fmt(v['a'], d)} → {_fmt(v['b'], d)} ({_signed(v['delta'], d)})")
        return "| " + " | ".join([name, *cells]) + " |"

    lines += [row(t, v) for t, v in doc["tasks"].items()]
    lines.append(row(f"**overall** ({doc['common_tasks']} common tasks)", doc["overall"]))
    notes = [f"A = {doc['a']['model']}, B = {doc['b']['model']}; Δ = B − A"]
    for side in ("a", "b"):
        only = doc[f"only_{side}"]
        if only:
            notes.append(f"only in {side.upper()} (left out of the overall): {', '.join(only)}")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


# Running an eval -----------------------------------------------------------------------------------------------------
Progress = Callable[[Rollout], None]
