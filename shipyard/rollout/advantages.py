"""Group-relative advantages, reward shaping terms, and the zero-variance test of dynamic sampling.

A group is N rollouts of one task from one prompt with distinct seeds. Its rewards r_1 … r_N (verdict reward plus
any shaping terms) are compared with each other instead of with a learned value function:

- **mean baseline** (GRPO, Shao et al. 2024, arXiv 2402.03300):  A_i = r_i − mean(r);
- **leave-one-out baseline** (RLOO, Ahmadian et al. 2024, arXiv 2402.14740):  A_i = r_i − mean_{j≠i} r_j
  = N/(N−1) · (r_i − mean(r)). The baseline of sample i does not depend on r_i, so the estimator is unbiased;
- **std normalisation** (optional, GRPO's default): A_i / (std(r) + ε), with the population standard deviation.
  Dr. GRPO (Liu et al. 2025, arXiv 2503.20783) shows it up-weights groups whose rewards barely differ — tasks the
  policy almost always or almost never solves — a question-level difficulty bias; hence it is off by default.

A rollout without a reward (`Rollout.masked`: infra_error, cancelled) is excluded from the statistics and gets
advantage 0 and mask 0: it is neither a zero reward nor a baseline member. With fewer than two rewarded rollouts a
group has no baseline and every advantage is 0.

A group whose rewarded rollouts all have the same reward (or fewer than two of them) teaches nothing — every
advantage is 0 — so dynamic sampling drops and replaces it (DAPO, Yu et al. 2025, arXiv 2503.14476): `no_signal`.

Shaping terms (`ShapingTerm`) are computed from the finished trajectory and added to the reward before the
advantages; each is recorded by name in `Rollout.shaping`, and `Rollout.reward` stays the grader's reward (the
curriculum tracks pass rates from that). Three are provided: `EffortPenalty`, a soft length penalty in the manner of
DAPO's overlong shaping (0 up to a free budget of sampled tokens, then linear down to −coef at the limit),
`ParallelBonus`, a bonus for the mean number of tool calls issued in parallel per turn, paid only on solved
rollouts so that spraying calls cannot earn it, and `GroundedCalls`, for grounded tool-call validity
(`shipyard.harness.validity`): with G the rollout's *distinct* grounded calls (a call identical in name and arguments
to an earlier one counts once; a call grounded but for its `<tool_call>` tags — `untagged_ran` — counts
`untagged_credit`) and K = `target`,

    shaping = coef · min(G, K)/K − placeholder_coef · [some call copied a placeholder],

bounded in [−placeholder_coef, coef]. It is paid whatever the verdict: it exists to teach the format and real
arguments early, when almost no rollout is solved (the measured failure it answers: a reward for any parseable call
was met by copying the tool's parameter description, 15 of 16 "valid" calls). Why this shape (an adversarial review
of a first version, coef · grounded/calls, found each hole): a fraction of calls paid a rollout that made one cheap
call and stopped as much as one that worked, and let cheap calls dilute a copied placeholder away; a count without a
cap pays for spraying. Here failed calls cost nothing but the turn they took, a repeated call earns nothing, one
copied placeholder costs the whole penalty however many other calls surround it, and past K distinct grounded calls
only the verdict matters. It remains a lexical proxy: K distinct cheap calls (`list_dir` of three directories) earn
the whole term — keep coef small next to the verdict's 1 so that solving stays what matters. `untagged_credit`
(default 0) exists for models that never write the tags: a term only the tagged form earns gives a group no variance
until a tag is sampled (0 of ~700 samples of the bundled 0.5B). No term is on unless the caller lists it.

`HackPenalty` (the RL loop's `run.zero_flagged`) takes a rollout the reward-hacking monitors flagged
(`Rollout.monitor_flags`) to a fixed floor, whatever its verdict and other terms: listed last, it cancels them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from shipyard.harness.tools import Tool
from shipyard.harness.validity import ValidityChecker
from shipyard.rollout.record import Rollout


def group_advantages(rewards: Sequence[float | None], *, std_normalize: bool = False, leave_one_out: bool = False,
                     eps: float = 1e-6) -> list[float]:
    """Advantages for one group; `None` marks a rollout without a reward (advantage 0, excluded from the stats)."""
    valid = [r for r in rewards if r is not None]
    k = len(valid)
    if k < 2:
        return [0.0] * len(rewards)
    mean = sum(valid) / k
    std = math.sqrt(sum((r - mean) ** 2 for r in valid) / k)
    scale = k / (k - 1) if leave_one_out else 1.0
    denom = std + eps if std_normalize else 1.0
    return [0.0 if r is None else scale * (r - mean) / denom for r in rewards]


def no_signal(rewards: Sequence[float | None], tol: float = 1e-9) -> bool:
    """True when a group's advantages would all be 0: fewer than two rewards, or all equal (within `tol`)."""
    valid = [r for r in rewards if r is not None]
    return len(valid) < 2 or max(valid) - min(valid) <= tol


class ShapingTerm(Protocol):
    """A reward term computed from a finished, rewarded rollout; recorded under `name` in `Rollout.shaping`."""

    name: str

    def __call__(self, rollout: Rollout) -> float: ...


@dataclass(frozen=True)
class EffortPenalty:
    """−coef · clamp((tokens − free) / (limit − free), 0, 1) over the rollout's sampled tokens."""

    free: int = 4096
    limit: int = 16384
    coef: float = 0.1
    name: str = "effort"

    def __post_init__(self) -> None:
        if not 0 <= self.free < self.limit:
            raise ValueError(f"EffortPenalty needs 0 <= free < limit, got free={self.free}, limit={self.limit}")

    def __call__(self, rollout: Rollout) -> float:
        traj = rollout.trajectory
        tokens = traj.sampled_tokens if traj else 0
        return -self.coef * min(1.0, max(0.0, (tokens - self.free) / (self.limit - self.free)))


@dataclass(frozen=True)
class ParallelBonus:
    """coef · min(1, (mean parallel width − 1) / (cap − 1)) on solved rollouts (reward ≥ `solved`), else 0."""

    coef: float = 0.05
    cap: int = 4
    solved: float = 1.0
    name: str = "parallel"

    def __post_init__(self) -> None:
        if self.cap < 2:
            raise ValueError(f"ParallelBonus needs cap >= 2, got {self.cap}")

    def __call__(self, rollout: Rollout) -> float:
        traj = rollout.trajectory
        if rollout.reward is None or rollout.reward < self.solved or traj is None:
            return 0.0
        widths = [t.parallel_width for t in traj.turns if t.parallel_width]
        if not widths:
            return 0.0
        mean = sum(widths) / len(widths)
        return self.coef * min(1.0, max(0.0, (mean - 1) / (self.cap - 1)))


@dataclass(frozen=True)
class GroundedCalls:
    """coef · min(G, target)/target − placeholder_coef · [some call copied a placeholder], G the rollout's distinct
    grounded calls (+ `untagged_credit` for each distinct call grounded but for its tags); see the module docstring.

    `tools`: the tool set the episodes were run with (the descriptions placeholders are copied from); None means
    `default_tools()`, the harness's.
    """

    coef: float = 0.1
    placeholder_coef: float = 0.1
    tools: tuple[Tool, ...] | None = None
    untagged_credit: float = 0.0  # in [0, 1]: the share of a grounded call's credit an untagged one earns
    target: int = 3  # distinct grounded calls that earn the whole term
    name: str = "grounded"
    checker: ValidityChecker = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coef) and math.isfinite(self.placeholder_coef)) or min(
                self.coef, self.placeholder_coef) < 0:
            raise ValueError(f"GroundedCalls needs finite coef >= 0 and placeholder_coef >= 0, got coef={self.coef}, "
                             f"placeholder_coef={self.placeholder_coef}; a negative coef would reward bad calls")
        if not 0 <= self.untagged_credit <= 1:
            raise ValueError(f"GroundedCalls needs 0 <= untagged_credit <= 1, got {self.untagged_credit}")
        if self.target < 1:
            raise ValueError(f"GroundedCalls needs target >= 1, got {self.target}")
        object.__setattr__(self, "checker", ValidityChecker(self.tools))

    def __call__(self, rollout: Rollout) -> float:
        if rollout.trajectory is None:
            return 0.0
        credit: dict[str, float] = {}  # per distinct call (name and arguments): repeating a call earns nothing more
        placeholder = False
        for turn in rollout.trajectory.turns:
            for record in turn.calls:
                verdict = self.checker.call(record)
                placeholder |= bool(verdict.placeholders)
                earned = 1.0 if verdict.grounded else self.untagged_credit if verdict.problem == "untagged_ran" else 0
                credit[record.key] = max(credit.get(record.key, 0.0), earned)
        return self.coef * min(sum(credit.values()), self.target) / self.target - self.placeholder_coef * placeholder


@dataclass(frozen=True)
class HackPenalty:
    """Shaping term: a rollout a monitor flagged ends with total reward `floor` (its reward and the shaping terms
    applied before this one are cancelled; keep it last), else 0. `floor` must be the lowest total a clean rollout can
    get (0 minus the largest penalty of the other terms), so that a flagged rollout never has a positive advantage:
    at 0, a group whose clean rollouts were charged a penalty would rank the hack above them."""

    floor: float = 0.0
    name: str = "hack"

    def __call__(self, rollout: Rollout) -> float:
        if not rollout.monitor_flags:
            return 0.0
        return self.floor - ((rollout.reward or 0.0) + sum(v for k, v in rollout.shaping.items() if k != self.name))


class GroupShapingTerm(Protocol):
    """A reward term computed from a whole finished group of one task (of curriculum tier `tier`): one value per
    rollout, recorded under `name` in `Rollout.shaping` (0 for a masked rollout)."""

    name: str

    def group(self, rollouts: Sequence[Rollout], tier: int) -> list[float]: ...


@dataclass(frozen=True)
class EffortCalibration:
    """Effort calibration (issue 16): little work for easy tasks, more allowed for hard ones, relative to the group.

    A rollout's effort is e = sampled tokens + `turn_tokens` · turns (a turn also costs a tool round trip and a longer
    context). Within a group, with e_min and e_max over its *solved* rollouts, the length reward of Kimi k1.5 (arXiv
    2501.12599, §2.3.3) is λ = 0.5 − (e − e_min)/(e_max − e_min) ∈ [−0.5, 0.5], paid as

        shaping = coef · s_tier · λ   on solved rollouts, 0 on the others

    so among solutions the shortest earns the most. Failures get nothing either way: Kimi's min(0, λ) for them would
    give a group of failures a gradient towards failing sooner (giving up after one turn would rank first), and the
    scheduler's dynamic sampling would keep such groups for it. s_tier = `tier_scale`[tier − 1] (the last entry for
    higher tiers): hard tiers get a smaller cost, so they may take longer. Fewer than two solutions, or solutions of
    equal effort, get 0."""

    coef: float = 0.1
    turn_tokens: int = 256
    tier_scale: tuple[float, ...] = (1.0, 0.5, 0.25)
    solved: float = 1.0
    name: str = "effort_calibration"

    def __post_init__(self) -> None:
        if not math.isfinite(self.coef) or self.coef < 0 or self.turn_tokens < 0:
            raise ValueError(f"EffortCalibration needs coef >= 0 and turn_tokens >= 0, got coef={self.coef}, "
                             f"turn_tokens={self.turn_tokens}")
        if not self.tier_scale or any(not math.isfinite(s) or s < 0 for s in self.tier_scale):
            raise ValueError(f"EffortCalibration needs a non-empty tier_scale of numbers >= 0, got {self.tier_scale}")

    def effort(self, rollout: Rollout) -> int:
        traj = rollout.trajectory
        return traj.sampled_tokens + self.turn_tokens * len(traj.turns) if traj else 0

    def group(self, rollouts: Sequence[Rollout], tier: int) -> list[float]:
        solved = [r.reward is not None and r.reward >= self.solved for r in rollouts]
        efforts = [self.effort(r) for r in rollouts]
        scored = [e for e, s in zip(efforts, solved, strict=True) if s]
        if len(scored) < 2 or max(scored) == min(scored):
            return [0.0] * len(rollouts)
        lo, hi = min(scored), max(scored)
        scale = self.coef * self.tier_scale[min(max(tier, 1), len(self.tier_scale)) - 1]
        return [scale * (0.5 - (e - lo) / (hi - lo)) if s else 0.0 for e, s in zip(efforts, solved, strict=True)]


def shaped_rewards(rollouts: Sequence[Rollout], terms: Sequence[ShapingTerm],
                   group_terms: Sequence[GroupShapingTerm] = (), tier: int = 1) -> list[float | None]:
    """A finished group's rewards: the group terms first, then each rollout's own terms (`shaped_reward`; so a term
    that reads the others, like `HackPenalty`, sees the group terms too)."""
    for term in group_terms:
        values = term.group(rollouts, tier)
        for rollout, value in zip(rollouts, values, strict=True):
            if rollout.reward is not None:
                rollout.shaping[term.name] = _finite(float(value), term.name, rollout)
    return [shaped_reward(r, terms) for r in rollouts]


def _finite(value: float, name: str, rollout: Rollout) -> float:
    if not math.isfinite(value):  # one NaN would make its whole group's advantages NaN
        raise ValueError(f"shaping term {name!r} returned {value} for rollout {rollout.group_id}/{rollout.index}: a "
                         f"shaping term must return a finite number")
    return value


def shaped_reward(rollout: Rollout, terms: Sequence[ShapingTerm]) -> float | None:
    """Apply the shaping terms to a rewarded rollout (recording each in `rollout.shaping`); None when masked."""
    if rollout.reward is None:
        return None
    for term in terms:
        rollout.shaping[term.name] = _finite(float(term(rollout)), term.name, rollout)
    return rollout.reward + sum(rollout.shaping.values())
