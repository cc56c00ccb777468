"""Difficulty and curriculum: which task the rollout server should run next.

GRPO-style training learns only from groups whose rewards differ: a task the policy always solves (p = 1) or
never solves (p = 0) gives every rollout the same advantage, zero. The variance of a Bernoulli reward, p(1 − p),
is the expected signal, so tasks are sampled with weight p(1 − p) where p is the task's pass rate — tracked as an
exponential moving average of its groups' mean rewards (unseen tasks count as p = 0.5, the most informative).
Tasks outside the band [0.1, 0.9] are not sampled while any task inside it is (DAPO's dynamic sampling filters
such groups after the fact, Yu et al. 2025, arXiv 2503.14476; filtering before sampling saves the rollouts).

Tiers open one at a time: training starts on the lowest tier present, and the next one opens when over half of
the open pool passes more than 90 % of the time. A task whose EMA has passed the retirement threshold after
enough attempts is retired: never sampled again, reported as solved.

**Base rates.** With `baseline` (a file of per-task base pass rates of the starting model, `shipyard.tasks.baseline`),
each task it covers starts with its base pass@1 as its EMA and its samples as attempts, instead of the 0.5 prior:
the first groups go to tasks the model sometimes solves. `baseline_band = [lo, hi]` leaves out of training every
task whose base pass@1 is outside it (tasks the baseline does not cover are kept, at the 0.5 prior): with n base
samples, `[1/n, 1 − 1/n]` (or `[0.01, 0.99]` for n ≤ 100) keeps exactly the tasks the base sometimes solves and
sometimes fails. Seeded tasks retire and open tiers by the same rules as measured ones.

Difficulty of a task is described by its tier, lines and symbols deleted and FAIL_TO_PASS count (`Difficulty`).
`state()`/`load_state()` round-trip through JSON for checkpoints.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from shipyard.errors import UsageError
from shipyard.tasks.baseline import TaskRate, load
from shipyard.tasks.taskset import list_tasks, load_task


@dataclass(frozen=True)
class Difficulty:
    tier: int
    lines_deleted: int
    symbols_deleted: int
    fail_to_pass: int


@dataclass
class TaskState:
    difficulty: Difficulty
    ema: float | None = None  # pass-rate EMA; None until the first group
    attempts: int = 0  # rollouts recorded
    retired: bool = False


@dataclass
class CurriculumConfig:
    ema_decay: float = 0.7  # weight of the old EMA when a new group arrives
    band: tuple[float, float] = (0.1, 0.9)
    escalate_pass_rate: float = 0.9  # a task "passes" the tier gate above this EMA ...
    escalate_fraction: float = 0.5  # ... and the next tier opens when more than this fraction of the pool does
    retire_pass_rate: float = 0.95
    retire_min_attempts: int = 16
    baseline: Path | None = None  # per-task base pass rates (TASKS/baseline/<model>.json): the EMA's starting point
    baseline_band: tuple[float, float] = (0.0, 1.0)  # train only on tasks whose base pass@1 is inside (inclusive)

    def __post_init__(self) -> None:
        lo, hi = self.baseline_band
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"curriculum.baseline_band must be [lo, hi] with 0 <= lo <= hi <= 1, got {[lo, hi]}")


class Curriculum:
    def __init__(self, tasks: dict[str, Difficulty], config: CurriculumConfig | None = None,
                 base: Mapping[str, TaskRate] | None = None):
        """`base`: per-task base rates (module docstring), those of tasks not in `tasks` ignored."""
        self.config = config or CurriculumConfig()
        if base:
            lo, hi = self.config.baseline_band
            tasks = {t: d for t, d in tasks.items() if t not in base
                     or lo <= base[t].successes / base[t].samples <= hi}
            if not tasks:
                raise UsageError(f"no task's base pass@1 is inside curriculum.baseline_band {[lo, hi]}: widen the band "
                                 "or start from a model that solves some of these tasks")
        if not tasks:
            raise ValueError("a curriculum needs at least one task")
        self.tasks = {tid: TaskState(d) for tid, d in tasks.items()}
        self.tiers = sorted({d.tier for d in tasks.values()})
        self.open_tier = self.tiers[0]
        for tid, rate in (base or {}).items():
            if tid in self.tasks:
                state = self.tasks[tid]
                state.ema, state.attempts = rate.successes / rate.samples, rate.samples
                self._retire(state)
        self._maybe_escalate()

    @classmethod
    def from_taskset(cls, tasks_dir: Path, config: CurriculumConfig | None = None,
                     exclude: Collection[str] = ()) -> Curriculum:
        """The curriculum of the task set's tasks but those in `exclude` (the held-out ones: never sampled), with the
        base rates of `config.baseline` when it names a file."""
        config = config or CurriculumConfig()
        tasks = {}
        for tid in list_tasks(tasks_dir):
            if tid in exclude:
                continue
            task, _ = load_task(tasks_dir, tid)
            tasks[tid] = Difficulty(task.tier, task.lines_deleted, len(task.deleted), len(task.fail_to_pass))
        base = load(config.baseline) if config.baseline is not None else None
        if base is not None and tasks and not set(base) & set(tasks):
            raise UsageError(f"the baseline {config.baseline} covers none of the {len(tasks)} training tasks of "
                             f"{tasks_dir}: is it the baseline of another task set?")
        return cls(tasks, config, base)

    def pool(self) -> list[str]:
        """Open, unretired tasks."""
        return [t for t, s in self.tasks.items() if s.difficulty.tier <= self.open_tier and not s.retired]

    def pass_rate(self, task_id: str) -> float:
        ema = self.tasks[task_id].ema
        return 0.5 if ema is None else ema

    def record(self, task_id: str, rewards: list[float]) -> None:
        """One group of rollouts of `task_id` finished with these rewards (infra failures excluded by the caller)."""
        if task_id not in self.tasks:
            raise KeyError(f"unknown task '{task_id}'")
        if not rewards:
            return
        state, c = self.tasks[task_id], self.config
        mean = sum(rewards) / len(rewards)
        state.ema = mean if state.ema is None else c.ema_decay * state.ema + (1 - c.ema_decay) * mean
        state.attempts += len(rewards)
        self._retire(state)
        self._maybe_escalate()

    def _retire(self, state: TaskState) -> None:
        c = self.config
        if state.attempts >= c.retire_min_attempts and state.ema is not None and state.ema >= c.retire_pass_rate:
            state.retired = True

    def _maybe_escalate(self) -> None:
        c = self.config
        while self.open_tier != self.tiers[-1]:
            open_tasks = [s for s in self.tasks.values() if s.difficulty.tier <= self.open_tier]
            passing = sum(s.ema is not None and s.ema > c.escalate_pass_rate for s in open_tasks)
            if passing <= c.escalate_fraction * len(open_tasks):
                return
            self.open_tier = self.tiers[self.tiers.index(self.open_tier) + 1]

    def weights(self) -> dict[str, float]:
        """Sampling weights ∝ p(1 − p) over the open pool, restricted to the band when any task is inside it."""
        pool = self.pool()
        lo, hi = self.config.band
        inside = [t for t in pool if lo <= self.pass_rate(t) <= hi]
        chosen = inside or pool
        raw = {t: max(self.pass_rate(t) * (1 - self.pass_rate(t)), 1e-6) for t in chosen}
        total = sum(raw.values())
        return {t: w / total for t, w in raw.items()} if total else {}

    def sample(self, n: int, rng: random.Random | None = None) -> list[str]:
        w = self.weights()
        if not w:
            raise RuntimeError("every task is retired: the policy solves the whole task set; synthesize harder "
                               "tasks (`shipyard synth --tier 3`) or add repositories")
        rng = rng or random.Random()
        ids = sorted(w)
        return rng.choices(ids, weights=[w[t] for t in ids], k=n)

    def state(self) -> dict:
        return {"open_tier": self.open_tier, "tasks": {t: asdict(s) for t, s in self.tasks.items()}}

    def load_state(self, state: dict) -> None:
        self.open_tier = state["open_tier"]
        for tid, raw in state["tasks"].items():
            if tid in self.tasks:
                self.tasks[tid] = TaskState(Difficulty(**raw["difficulty"]), raw["ema"], raw["attempts"],
                                            raw["retired"])
