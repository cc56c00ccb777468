"""A scripted `Transport` for scheduler tests: episodes of simulated turns with scripted rewards, delays and faults.

`ScriptedTransport(script)` runs an episode by asking `script(spec)` for an `Outcome` — the reward, how many turns,
how long each takes, or a fault (`infra` returns an infra_error record, `lost` raises `WorkerLost`) — and then
sleeping through the turns, recording on each the policy version current when it started, checking `cancelled()`
between turns. Everything it did is logged (`runs`, `starts`) so tests can check order and seeds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from shipyard.harness.trajectory import Trajectory, Turn
from shipyard.rollout.record import EpisodeSpec, Rollout
from shipyard.rollout.transport import WorkerLost


@dataclass
class Outcome:
    reward: float = 0.0
    turns: int = 2
    turn_seconds: float = 0.001
    fault: str | None = None  # None | "infra" | "lost"
    tokens: int = 3


def turn(index: int, version: int, tokens: int = 3) -> Turn:
    return Turn(index=index, text="x", completion_ids=[7] * tokens, logprobs=[-0.5] * tokens, finish_reason="stop",
                observation_ids=[9, 9], calls=[], parallel_width=1, generate_seconds=0.0, tools_seconds=0.0,
                policy_version=version)


class ScriptedTransport:
    def __init__(self, script: Callable[[EpisodeSpec], Outcome], capacity: int = 4):
        self.script, self._capacity = script, capacity
        self.version = 0
        self.runs: list[EpisodeSpec] = []  # every call, in start order
        self.starts: list[tuple[EpisodeSpec, int]] = []  # (spec, version at start)
        self.running = 0
        self.peak = 0
        self.closed = False

    async def run(self, spec: EpisodeSpec, cancelled: Callable[[], bool]) -> Rollout:
        self.runs.append(spec)
        self.starts.append((spec, self.version))
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            out = self.script(spec)
            traj = Trajectory(task=spec.task_id, model="scripted", prompt_ids=[1, 2, 3])
            base = dict(task_id=spec.task_id, group_id=spec.group_id, index=spec.index, seed=spec.seed,
                        attempt=spec.attempt, trajectory=traj)
            start = time.monotonic()
            for i in range(out.turns):
                if cancelled():
                    return Rollout(**base, status="cancelled", reward=None, stop_reason="cancelled")
                if spec.wall_time is not None and time.monotonic() - start > spec.wall_time:  # as the agent loop
                    return Rollout(**base, status="graded", reward=0.0, stop_reason="wall_time")
                version = self.version  # the version that starts sampling the turn (its oldest token's)
                await asyncio.sleep(out.turn_seconds)
                traj.turns.append(turn(i, version, out.tokens))
            if out.fault == "lost":
                raise WorkerLost(f"worker running {spec.rollout_id} died")
            if out.fault == "infra":
                return Rollout(**base, status="infra_error", reward=None, stop_reason="infra_error",
                               infra_cause="EnvServerUnreachable: connection refused")
            return Rollout(**base, status="graded", reward=out.reward, stop_reason="finished")
        finally:
            self.running -= 1

    async def update_weights(self, version: int, tensors) -> None:
        self.version = version

    def capacity(self) -> int:
        return self._capacity

    async def close(self) -> None:
        self.closed = True


async def wait_until(predicate: Callable[[], bool], timeout: float = 120.0) -> None:
    """Poll `predicate` every 50 ms until it holds (what a test waits for, not a guess at how long it takes)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"still waiting after {timeout} s"
        await asyncio.sleep(0.05)
