"""What the scheduler hands the trainer: a `RolloutBatch` of complete groups with their advantages.

A batch holds G groups of N rollouts each, in the order the scheduler accepted them. Per rollout: its advantage
(group-relative, shaping included, 0 for masked rollouts), its mask (0 = no reward: infra_error or cancelled — the
trainer must skip it, never treat it as a zero reward), and the policy versions of its turns. `min_version` (the
trainer's version minus `max_staleness`): tokens sampled by an older policy are context only (`Batch.from_rollouts`
masks them). `hints` is the slot for targeted self-distillation (`shipyard.rollout.record.Hint`, indexed by the flat
rollout position), filled by the RL loop after the batch is made. `shipyard.train.batch.Batch.from_rollouts` turns a
batch into padded tensors.

`metrics()` gives one flat JSON object per rollout (`Rollout.metrics` plus the step, the trainer version and the
rollout's staleness), and `write_metrics(path)` appends them as JSON lines (`append_jsonl`), one file per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shipyard.rollout.record import Hint, Rollout, append_jsonl


@dataclass
class RolloutGroup:
    """N rollouts of one task (one prompt, distinct seeds), complete, with their advantages set."""

    task_id: str
    group_id: str
    rollouts: list[Rollout]
    started_version: int = 0  # the trainer version when the group started (for rollouts with no turns)
    seconds: float = 0.0  # from the group's first start to its last rollout's end
    seq: int = 0  # the scheduler's count of groups started before this one

    @property
    def rewards(self) -> list[float | None]:
        return [r.reward for r in self.rollouts]

    @property
    def oldest_version(self) -> int:
        return min((v for r in self.rollouts for v in r.versions), default=self.started_version)


@dataclass
class RolloutBatch:
    groups: list[RolloutGroup]
    step: int = 0  # the scheduler's batch counter
    trainer_version: int = 0  # the trainer version when the batch was handed out
    min_version: int | None = None  # tokens sampled by an older version are context, not trained on (None: all)
    hints: list[Hint] = field(default_factory=list)

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]

    @property
    def advantages(self) -> list[float]:
        return [0.0 if r.advantage is None else r.advantage for r in self.rollouts]

    @property
    def masks(self) -> list[int]:
        """1 for a rollout with a reward, 0 for a masked one (infra_error, cancelled)."""
        return [0 if r.masked else 1 for r in self.rollouts]

    @property
    def versions(self) -> list[list[int]]:
        """Per rollout, the policy version of each turn."""
        return [r.versions for r in self.rollouts]

    def staleness(self) -> list[int]:
        """Per rollout, how many versions its oldest turn is behind the trainer (0 for rollouts with no turns)."""
        return [self.trainer_version - min(r.versions, default=self.trainer_version) for r in self.rollouts]

    def metrics(self) -> list[dict[str, Any]]:
        return [{**r.metrics(), "step": self.step, "trainer_version": self.trainer_version, "staleness": s}
                for r, s in zip(self.rollouts, self.staleness(), strict=True)]

    def write_metrics(self, path: Path) -> None:
        append_jsonl(path, self.metrics())

    def summary(self) -> dict[str, Any]:
        rewards = [r.reward for r in self.rollouts if r.reward is not None]
        return {"step": self.step, "trainer_version": self.trainer_version, "groups": len(self.groups),
                "rollouts": len(self.rollouts), "masked": self.masks.count(0),
                "mean_reward": sum(rewards) / len(rewards) if rewards else None,
                "max_staleness": max(self.staleness(), default=0)}
