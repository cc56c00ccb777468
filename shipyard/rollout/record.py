"""The `Rollout` record: one episode of one task, everything the trainer, `eval` and the dashboard need from it.

A rollout is identified by (task, group, sample index, attempt). Its `seed` is derived from the run seed, the task
and the sample index only (`rollout_seed`), so a rerun of the same configuration draws the same samples, the N
samples of a group draw different ones, and a retried attempt (after an infrastructure failure) replays the same
seed. Every turn of the trajectory records the policy version that sampled it (`versions`), which is what
bounded-staleness admission and the trainer's importance correction read.

`status` is the grader's verdict status (graded | patch_rejected | patch_failed | tampered | no_report | crashed |
timeout) or, when the episode itself could not be completed, `infra_error` (an environment server, sandbox, engine
or the grader's infrastructure failed; `infra_cause` says which) or `cancelled` (its time budget ran out). Those two
have `reward` None: they are masked or retried, never scored as zero.

A `Hint` is the targeted feedback the RL loop's detectors (`shipyard.rl.hints`) write for one turn of one rollout of
a batch (`RolloutBatch.hints`); the trainer places it in token coordinates (`shipyard.train.batch.place_hint`) and
distils the hinted teacher into the policy on that turn (`shipyard.train.distill`). It is a plain record, kept here so
that the rollout side can carry hints without importing the trainer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shipyard.errors import FileFormatError
from shipyard.harness.trajectory import Trajectory

NO_REWARD = ("infra_error", "cancelled")  # statuses whose reward is None: masked or retried, never a zero


def rollout_seed(run_seed: int, task_id: str, index: int) -> int:
    """A 63-bit sampling seed for sample `index` of `task_id` in a run seeded `run_seed`: reproducible, distinct
    across samples and tasks (BLAKE2b of the three, so nearby seeds or ids do not give correlated streams)."""
    digest = hashlib.blake2b(f"{run_seed}\0{task_id}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass(frozen=True)
class EpisodeSpec:
    """What to run: sample `index` of group `group_id` on task `task_id` (a directory of the task set `tasks_dir`)."""

    task_id: str
    tasks_dir: Path
    group_id: str
    index: int
    seed: int
    attempt: int = 0
    # The agent's wall-clock budget for this attempt (seconds; None: the loop config's `wall_time`). Running out is
    # the model's doing: the episode stops with `wall_time` — mid-generation too — and its patch is graded. Only
    # cancellation the model cannot cause (a doomed group, shutdown) masks a rollout.
    wall_time: float | None = None

    @property
    def rollout_id(self) -> str:
        return f"{self.group_id}/{self.index}" + (f"~{self.attempt}" if self.attempt else "")

    @property
    def task_dir(self) -> Path:
        return Path(self.tasks_dir) / self.task_id


@dataclass(frozen=True)
class Hint:
    """Targeted feedback for rollout `sample` of a batch (its flat position): `hint_ids` (a rendered message) go
    before turn `turn`'s assistant header in the teacher's context."""

    sample: int
    turn: int
    hint_ids: tuple[int, ...]
    kinds: tuple[str, ...] = ()  # what was found (shipyard.rl.hints), for the run's logs
    text: str = ""
    evidence: tuple[str, ...] = ()


@dataclass
class Rollout:
    task_id: str
    group_id: str
    index: int
    seed: int
    status: str  # a verdict status, or infra_error / cancelled (reward None)
    reward: float | None
    trajectory: Trajectory | None = None  # kept for infra_error and cancelled too: nothing is lost
    attempt: int = 0
    stop_reason: str | None = None  # the agent loop's (finished, max_turns, …, infra_error, cancelled)
    verdict: dict[str, Any] | None = None  # Verdict.to_json() when the patch was graded
    infra_cause: str | None = None  # for infra_error: what failed, in one line
    monitor_flags: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: sandbox, agent, generate, tools, grade, total
    shaping: dict[str, float] = field(default_factory=dict)  # shaping terms added to the reward, by name
    advantage: float | None = None  # set by the scheduler when the group is complete
    engine: str | None = None  # which engine served the episode (routing; stickiness)
    worker: str | None = None  # which rollout worker ran it

    @property
    def rollout_id(self) -> str:
        return f"{self.group_id}/{self.index}" + (f"~{self.attempt}" if self.attempt else "")

    @property
    def masked(self) -> bool:
        """True when this rollout carries no reward (infra_error, cancelled): the trainer must not learn from it."""
        return self.reward is None

    @property
    def versions(self) -> list[int]:
        """The policy version of each turn (its oldest token's)."""
        return [t.policy_version for t in self.trajectory.turns] if self.trajectory else []

    @property
    def oldest_version(self) -> int | None:
        return min(self.versions, default=None)

    def metrics(self) -> dict[str, Any]:
        """One flat JSON line for the run's per-rollout metrics file."""
        summary = self.trajectory.summary() if self.trajectory else {}
        return {"rollout": self.rollout_id, "task": self.task_id, "group": self.group_id, "index": self.index,
                "seed": self.seed, "attempt": self.attempt, "status": self.status, "reward": self.reward,
                "advantage": self.advantage, "infra_cause": self.infra_cause, "stop_reason": self.stop_reason,
                "monitor_flags": len(self.monitor_flags), "versions": sorted(set(self.versions)),
                "engine": self.engine, "worker": self.worker, **{f"shaping_{k}": v for k, v in self.shaping.items()},
                **{f"{k}_seconds": round(v, 3) for k, v in self.timings.items()},
                **{k: v for k, v in summary.items() if k not in ("stop_reason", "seconds")}}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Rollout:
        traj = data.get("trajectory")
        return cls(**{**data, "trajectory": Trajectory.from_dict(traj) if traj is not None else None})


def append_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Append JSON lines (one write per call, so concurrent writers of whole lines do not interleave mid-line)."""
    if not records:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))


def read_rollout_lines(file: Path) -> list[Rollout]:
    """The rollout records of one JSON-lines file (`shipyard eval --rollouts`, a run's trajectories/step-*.jsonl).
    Keys a run adds beside a record (`hints`) are ignored; a line that is not a record is a FileFormatError naming
    its file and line."""
    out = []
    for number, line in enumerate(Path(file).read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            data.pop("hints", None)
            out.append(Rollout.from_json(data))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise FileFormatError(f"{file}:{number}: not a rollout record ({type(e).__name__}: {e}); such files "
                                  f"hold the lines of `shipyard eval --rollouts` and a run's trajectories/") from None
    return out
