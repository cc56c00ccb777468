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
curriculum tracks pass rates from that). Two are provided: `EffortPenalty`, a soft length penalty in the manner of
DAPO's overlong shaping (0 up to a free budget of sampled tokens, then linear down to −coef at the limit),
`ParallelBonus`, a bonus for the mean number of tool calls issued in parallel per turn, paid only on solved
rollouts so that spraying calls cannot earn it, and `GroundedCalls`, for grounded tool-call validity
(`shipyard.harness.validity`): with c calls of which g are grounded and p carry a placeholder argument,

    shaping = coef · (g + untagged_credit · u)/c − placeholder_coef · p/c        (0 when c = 0),

where u counts the calls that ran and would be grounded but were written outside the tags (the parser's
`untagged_calls="accept"`; `untagged_ran` in `shipyard.harness.validity`), bounded in [−placeholder_coef, coef].
`untagged_credit` (default 0) exists for models that never write the tags: a reward that only the tagged form earns
gives a group no variance until a tag is sampled (0 of ~700 samples of the bundled 0.5B), while partial credit
rewards real, working arguments now and the tags on top. The term is paid whatever the verdict: it exists to teach
the format and real arguments early, when almost no rollout is solved (the measured failure it answers: a reward for
any parseable call was met by copying the tool's parameter description, 15 of 16 "valid" calls). Fractions, not
counts, so that spraying calls earns nothing; the placeholder term makes a copied description cost more than a call
that merely failed. Keep coef small next to the verdict's 1 so that solving stays what matters. No term is on unless
the caller lists it.
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
        tokens = sum(len(t.completion_ids) for t in traj.turns) if traj else 0
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
    """coef · grounded/calls − placeholder_coef · placeholder/calls over the rollout's calls (0 without calls).

    `tools`: the tool set the episodes were run with (the descriptions placeholders are copied from); None means
    `default_tools()`, the harness's.
    """

    coef: float = 0.1
    placeholder_coef: float = 0.1
    tools: tuple[Tool, ...] | None = None
    untagged_credit: float = 0.0  # in [0, 1]: the share of `coef` an otherwise grounded untagged call earns
    name: str = "grounded"
    checker: ValidityChecker = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.coef < 0 or self.placeholder_coef < 0:
            raise ValueError(f"GroundedCalls needs coef >= 0 and placeholder_coef >= 0, got coef={self.coef}, "
                             f"placeholder_coef={self.placeholder_coef}; a negative coef would reward bad calls")
        if not 0 <= self.untagged_credit <= 1:
            raise ValueError(f"GroundedCalls needs 0 <= untagged_credit <= 1, got {self.untagged_credit}")
        object.__setattr__(self, "checker", ValidityChecker(self.tools))

    def __call__(self, rollout: Rollout) -> float:
        if rollout.trajectory is None:
            return 0.0
        stats = self.checker.trajectory(rollout.trajectory)
        if not stats.calls:
            return 0.0
        credit = stats.grounded + self.untagged_credit * stats.problems.get("untagged_ran", 0)
        return self.coef * credit / stats.calls - self.placeholder_coef * stats.placeholder_fraction


def shaped_reward(rollout: Rollout, terms: Sequence[ShapingTerm]) -> float | None:
    """Apply the shaping terms to a rewarded rollout (recording each in `rollout.shaping`); None when masked."""
    if rollout.reward is None:
        return None
    for term in terms:
        value = float(term(rollout))
        if not math.isfinite(value):  # one NaN would make its whole group's advantages NaN
            raise ValueError(f"shaping term {term.name!r} returned {value} for rollout {rollout.group_id}/"
                             f"{rollout.index}: a shaping term must return a finite number")
        rollout.shaping[term.name] = value
    return rollout.reward + sum(rollout.shaping.values())
