"""A synthesis run's record (`SynthReport`: what `synth.json` holds per project), a candidate's rejection, and the
CPU a run used.

CPU time is the process's and its waited-for children's rusage plus the CPU its sandboxes used, read from their
cgroups (`shipyard.sandbox.bwrap.sandbox_cpu`): sandboxed processes never show up in rusage. Where the host has no
cgroup that counts CPU, `unmeasured_sandboxes` says how many sandboxes' time is missing, and tasks per CPU-hour is
an upper bound.
"""

from __future__ import annotations

import resource
from collections import Counter
from dataclasses import asdict, dataclass, field

from shipyard.sandbox.bwrap import sandbox_cpu
from shipyard.tasks.taskset import Project, Task


@dataclass
class SynthReport:
    repo: str
    project: Project | None = None
    accepted: list[str] = field(default_factory=list)
    tried: int = 0
    rejections: Counter = field(default_factory=Counter)
    rejected: list[dict[str, str]] = field(default_factory=list)
    stable_tests: int = 0
    excluded_tests: dict[str, str] = field(default_factory=dict)  # node id → flaky | failing
    baseline_errors: list[str] = field(default_factory=list)  # pytest's lines for modules that failed to collect
    skipped: dict[str, str] = field(default_factory=dict)  # repo path → why it is in no task (links, special files)
    generated: list[str] = field(default_factory=list)  # .py files the editable build generated (kept)
    sdists: list[str] = field(default_factory=list)  # requirements fetched as source and built in the sandbox
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    unmeasured_sandboxes: int = 0  # sandboxes whose CPU time the host could not count (no cgroup cpu accounting)
    differential: dict[str, dict] = field(default_factory=dict)  # per tier ("T1"…): the differential check's reach
    requirements: list[str] = field(default_factory=list)  # what `--with` added (a pack's rebuild needs them too)
    rebuilt: dict = field(default_factory=dict)  # made from a pack (`pack.rebuild`): its synthesis report, re-graded

    def cover(self, task: Task) -> None:
        """Count an accepted task in its tier's differential coverage: tasks, tasks with cases, cases, and why the
        others have none."""
        d = self.differential.setdefault(f"T{task.tier}", {"tasks": 0, "with_cases": 0, "cases": 0, "why_none": {}})
        cases = task.differential.get("cases", 0)
        d["tasks"] += 1
        d["with_cases"] += cases > 0
        d["cases"] += cases
        if not cases:
            why = task.differential.get("why_none") or "synthesized without differential cases"
            d["why_none"][why] = d["why_none"].get(why, 0) + 1

    @property
    def yield_(self) -> float:
        return len(self.accepted) / self.tried if self.tried else 0.0

    @property
    def tasks_per_cpu_hour(self) -> float:
        return len(self.accepted) / (self.cpu_seconds / 3600) if self.cpu_seconds else 0.0

    def to_json(self) -> dict:
        out = asdict(self)
        out["rejections"] = dict(self.rejections)
        out |= {"yield": round(self.yield_, 3), "tasks_per_cpu_hour": round(self.tasks_per_cpu_hour, 1)}
        return out

    def headline(self) -> dict:
        """The figures `shipyard synth` prints: yield, rate, tries, rejections by reason, seconds."""
        summary = self.to_json()
        return {k: summary[k] for k in ("yield", "tasks_per_cpu_hour", "tried", "rejections", "differential",
                                        "seconds")}


class Rejected(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def cpu_used() -> tuple[float, int]:
    """(CPU seconds of this process, its reaped children and its closed sandboxes; sandboxes not measured)."""
    sandboxes, unmeasured = sandbox_cpu()
    return sandboxes + sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                           for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)), unmeasured
