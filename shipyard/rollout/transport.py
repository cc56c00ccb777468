"""How the scheduler runs an episode: the `Transport` seam, and the in-process implementation.

One scheduler, two transports. The `Scheduler` decides *what* to run (which task, which seed, which attempt, when
to stop admitting, what to do with a failure); a transport decides *where* it runs. `InProcessTransport` runs
`run_episode` on a thread pool of this process, sharing one engine (a continuous-batching `LocalEngine` or an
`EngineRouter` over several) and one `Environment`; the Ray transport (`shipyard/rollout/ray_transport.py`) runs
the same episode function on rollout-worker actors. Both speak asyncio, so the scheduler's code path is the same.

Failure contract, which the scheduler relies on:

- an *infrastructure* failure inside an episode (environment server, sandbox, engine, grader infrastructure) is
  data: `run` returns a `Rollout` with status `infra_error` and the trajectory kept; the scheduler retries it
  with the same seed or masks it;
- a *worker* that dies while running the episode (a killed process or actor) cannot return anything: `run`
  raises `WorkerLost`, and the scheduler re-queues the spec unchanged (counted), so nothing is lost;
- cancellation is cooperative: `cancelled()` is polled by the episode between turns (and by engines between decode
  steps where they can), and the episode returns status `cancelled` with what it had.

Threads, not processes, in-process: an episode spends its time waiting on the engine (which batches decode steps
across all the threads calling it) and on sandboxed subprocesses, neither of which holds the GIL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from shipyard.models.errors import InfraError
from shipyard.rollout.record import EpisodeSpec, Rollout

if TYPE_CHECKING:
    import torch

    from shipyard.models.engine import Engine
    from shipyard.rollout.environment import Environment
    from shipyard.rollout.episode import EpisodeConfig


class WorkerLost(InfraError):
    """The worker running an episode died before it could return a record (a killed process or actor). Nothing of
    the episode survives; the scheduler re-queues its spec (same seed, same attempt) and counts it."""


class Transport(Protocol):
    async def run(self, spec: EpisodeSpec, cancelled: Callable[[], bool]) -> Rollout:
        """Run one episode to a `Rollout` (infra failures come back as status `infra_error`, never raised).
        Raises `WorkerLost` when the worker running it died."""
        ...

    async def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Push new policy weights to every engine; they land between decode steps, so episodes in flight continue
        and their later tokens carry `version`."""
        ...

    def capacity(self) -> int:
        """How many episodes it can run at once (the scheduler keeps at most this many in flight)."""
        ...

    async def close(self) -> None: ...


class InProcessTransport:
    """Episodes on `workers` threads of this process, over one shared engine and environment.

    The transport does not own `engine` or `env`: whoever built them closes them (the CLI's `with` blocks, a test's
    fixtures). `close` waits for the threads; episodes still running finish (callers cancel them first through the
    scheduler's budgets or `cancelled` callbacks)."""

    def __init__(self, engine: Engine, env: Environment, config: EpisodeConfig, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.engine, self.env, self.config, self.workers = engine, env, config, workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="rollout")
        self._closed = False

    async def run(self, spec: EpisodeSpec, cancelled: Callable[[], bool]) -> Rollout:
        if self._closed:
            raise RuntimeError("the transport is closed")
        from shipyard.rollout.episode import run_episode  # imports torch (~7 s): not at import of the scheduler

        loop = asyncio.get_running_loop()
        rollout = await loop.run_in_executor(self._pool, run_episode, spec, self.engine, self.env, self.config,
                                             cancelled)
        rollout.worker = rollout.worker or "in-process"
        return rollout

    async def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        await asyncio.to_thread(self.engine.update_weights, version, tensors)

    def capacity(self) -> int:
        return self.workers

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self._pool.shutdown, True)
