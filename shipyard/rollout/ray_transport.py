"""`RayTransport`: the scheduler's episodes on a Ray cluster — engines, rollout workers and environment servers as
actors (shipyard/rollout/ray_actors.py), on one machine (`ray.init(num_cpus=…)`) or joining a cluster by address.

One scheduler, two transports: the `Scheduler` is the same object over `InProcessTransport` or this; only where an
episode runs changes. Ray is an optional extra (`pip install 'shipyard[ray]'`); nothing imports this module but
code that asked for the Ray backend.

Layout. `engines` engine actors each hold an engine built from the model name (a continuous-batching `LocalEngine`
on a GPU or CPUs, `openai:` servers, `replay:`, or a vLLM server the actor starts on its node for `vllm:`),
`workers` rollout-worker actors each run up to `concurrency` episodes on threads, and `env_servers` environment-
server actors serve sandboxes and grading on 127.0.0.1 of their node. Worker i is placed on the node of environment
server i mod n, and uses it through `RemoteEnvironment`; with no environment servers, each worker makes its
sandboxes in its own process (`LocalEnvironment`). Every worker routes generation through its own `EngineRouter`
over all engine actors: a rollout sticks to one engine (its KV cache), a new one goes to the least loaded (each
actor counts the sequences it has in flight, from every worker).

Faults (the `Transport` contract, shipyard/rollout/transport.py):
- A rollout worker that dies (killed, out of memory, its node lost) fails every episode it held with
  `RayActorError`; each of those `run` calls raises `WorkerLost`, the scheduler re-queues the spec, and the
  transport starts a replacement worker in the same slot (once per death; counted in `stats()`).
- An engine actor that dies raises `EngineLost` (an `InfraError`) in the workers' engine proxies; their routers
  retry the request on another engine, so the episode continues. With no engine left the episode ends
  `infra_error` with its trajectory, and the scheduler retries or masks it — never a silent zero. A lost engine is
  not restarted: a fresh one would serve the initial weights under the current version's name.
- Cancellation crosses processes by message: while `run` waits it polls `cancelled()` and tells the worker, whose
  episode sees its flag between turns; the engine proxy does the same for requests between decode steps.
- `update_weights` puts the tensors in the object store once and sends that one object to every live engine actor.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shipyard.rollout.ray_actors import POLL, EngineActor, EngineInfo, EngineLost, EnvServerActor, RolloutWorker
from shipyard.rollout.record import EpisodeSpec, Rollout
from shipyard.rollout.transport import WorkerLost

if TYPE_CHECKING:
    import torch

    from shipyard.models.lora import LoraConfig
    from shipyard.models.vllm_server import VLLMConfig
    from shipyard.rollout.episode import EpisodeConfig


@dataclass
class RayConfig:
    address: str | None = None  # a cluster to join ("auto", "HOST:PORT", "ray://HOST:PORT"); None: start Ray here
    num_cpus: int | None = None  # CPUs of a Ray started here (None: all of this machine's)
    engines: int = 1
    workers: int = 2
    concurrency: int = 4  # episodes one worker runs at once (threads in the actor)
    env_servers: int = 1  # 0: workers make sandboxes and grade in their own process (LocalEnvironment)
    allowed_roots: tuple[Path, ...] = ()  # directories the environment servers may snapshot (the task sets)
    device: str = "cpu"  # where engine actors put a local model
    tokenizer: str | None = None  # for engines that only see ids (openai:, replay:)
    engine_cpus: float = 1.0  # Ray resources one engine actor reserves
    engine_gpus: float = 0.0
    engine_concurrency: int = 64  # generate calls one engine actor serves at once (≥ the rollouts that reach it)
    runtime_env: dict = field(default_factory=dict)  # passed to ray.init when starting Ray here

    def __post_init__(self) -> None:
        for name in ("engines", "workers", "concurrency", "engine_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"RayConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.env_servers < 0:
            raise ValueError(f"RayConfig.env_servers must be at least 0, got {self.env_servers}")
        if self.env_servers and not self.allowed_roots:
            raise ValueError("environment servers need allowed_roots: the task set directories they may snapshot")


@dataclass
class _Slot:
    """One rollout worker's place: the actor in it now (replaced when it dies) and the episodes it holds."""

    index: int
    env_address: tuple[str, str] | None
    node: str | None
    handle: ray.actor.ActorHandle | None = None
    generation: int = 0
    in_flight: int = 0

    @property
    def label(self) -> str:
        return f"ray-worker-{self.index}" + (f".{self.generation}" if self.generation else "")


class RayTransport:
    """The `Transport` over Ray actors (see the module docstring). Building it starts every actor and waits until
    the engines have loaded, so a bad model name or an unreachable cluster fails here, not in the first episode."""

    def __init__(self, model: str, config: EpisodeConfig, ray_config: RayConfig | None = None,
                 lora: LoraConfig | None = None, vllm: VLLMConfig | None = None):
        self.model, self.config, self.lora = model, config, lora  # lora: the trainer's adapter, on every engine
        self.vllm = vllm  # the settings of the server each engine actor starts for a vllm: model
        self.ray_config = rc = ray_config or RayConfig()
        self.started_ray = False
        if not ray.is_initialized():
            if rc.address is not None:
                ray.init(address=rc.address, runtime_env=rc.runtime_env or None)
            else:
                ray.init(num_cpus=rc.num_cpus, include_dashboard=False, runtime_env=rc.runtime_env or None)
            self.started_ray = True
        self.counts: Counter[str] = Counter()
        self._closed = False
        self.engines: list[ray.actor.ActorHandle] = []
        self.env_servers: list[ray.actor.ActorHandle] = []
        self.slots: list[_Slot] = []
        try:
            self._start(rc)
        except BaseException:
            self._stop_actors()
            raise

    def _start(self, rc: RayConfig) -> None:
        engine_actor = EngineActor.options(num_cpus=rc.engine_cpus, num_gpus=rc.engine_gpus, max_restarts=0,
                                           max_concurrency=rc.engine_concurrency)
        self.engines = [engine_actor.remote(self.model, rc.device, rc.tokenizer, self.lora, self.vllm)
                        for _ in range(rc.engines)]
        server_actor = EnvServerActor.options(num_cpus=0, max_restarts=0)
        self.env_servers = [server_actor.remote(tuple(Path(r) for r in rc.allowed_roots))
                            for _ in range(rc.env_servers)]
        described = ray.get([e.describe.remote() for e in self.engines])  # waits for every model to load
        self.engine_infos = [EngineInfo(handle, f"{name}@ray-engine-{i}", tokenizer, version)  # named apart
                             for i, (handle, (name, tokenizer, version)) in enumerate(zip(self.engines, described,
                                                                                         strict=True))]
        self.engine_alive = [True] * len(self.engines)
        servers = ray.get([s.address.remote() for s in self.env_servers])
        for i in range(rc.workers):
            url, token, node = servers[i % len(servers)] if servers else (None, None, None)
            self.slots.append(_Slot(i, (url, token) if url else None, node))
        for slot in self.slots:
            self._spawn(slot)
        ray.get([slot.handle.ready.remote() for slot in self.slots])  # a worker that cannot start fails here

    def _spawn(self, slot: _Slot) -> None:
        options = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": self.ray_config.concurrency}
        if slot.node is not None:  # its environment server listens on that node's loopback only
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(slot.node, soft=False)
        slot.handle = RolloutWorker.options(**options).remote(slot.label, self.engine_infos, slot.env_address,
                                                               self.config)

    def _replace(self, slot: _Slot, generation: int) -> None:
        """Start a new worker in `slot` if the one that failed (`generation`) is still there (a death fails every
        episode the worker held; only the first replaces it)."""
        if self._closed or slot.generation != generation:
            return
        ray.kill(slot.handle, no_restart=True)  # unreachable is not always dead; make sure it holds nothing
        slot.generation += 1
        self.counts["workers_replaced"] += 1
        self._spawn(slot)

    async def run(self, spec: EpisodeSpec, cancelled: Callable[[], bool]) -> Rollout:
        if self._closed:
            raise RuntimeError("the transport is closed")
        slot = min(self.slots, key=lambda s: s.in_flight)
        handle, generation = slot.handle, slot.generation
        slot.in_flight += 1
        try:
            future = asyncio.wrap_future(handle.run.remote(spec).future())
            told = False
            while True:
                done, _ = await asyncio.wait({future}, timeout=POLL)
                if done:
                    return future.result()
                if not told and cancelled():
                    handle.cancel.remote(spec.rollout_id)
                    told = True
        except RayActorError as e:
            if isinstance(e, RayTaskError):  # the episode raised an actor error of its own (a nested actor's): a bug
                raise
            if e.actor_init_failed:  # a replacement that cannot start would be replaced forever: say why instead
                raise RuntimeError(f"rollout worker {slot.label} could not start: {e}") from e
            self.counts["workers_lost"] += 1
            self._replace(slot, generation)
            raise WorkerLost(f"rollout worker {slot.label if slot.generation == generation else 'replaced'} died "
                             f"running {spec.rollout_id}: {type(e).__name__}") from e
        except asyncio.CancelledError:
            handle.cancel.remote(spec.rollout_id)
            raise
        finally:
            slot.in_flight -= 1

    async def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        live = [info for i, info in enumerate(self.engine_infos) if self.engine_alive[i]]
        payload = ray.put(dict(tensors))  # one copy in the object store, read by every engine
        results = await asyncio.gather(*(asyncio.wrap_future(info.handle.update_weights.remote(version, payload)
                                                             .future()) for info in live), return_exceptions=True)
        for info, result in zip(live, results, strict=True):
            if isinstance(result, RayActorError) and not isinstance(result, RayTaskError):  # the actor is gone
                self.engine_alive[self.engine_infos.index(info)] = False
                self.counts["engines_lost"] += 1
            elif isinstance(result, BaseException):
                raise result
        if not any(self.engine_alive):
            raise EngineLost(f"no engine actor is left to take weights version {version}")

    def capacity(self) -> int:
        return self.ray_config.workers * self.ray_config.concurrency

    def stats(self) -> dict[str, int]:
        """Counters: workers_lost (episodes whose worker died), workers_replaced, engines_lost (seen by updates)."""
        return dict(self.counts)

    def worker(self, index: int) -> ray.actor.ActorHandle:
        """The actor in worker slot `index` now (operators and tests: kill it, ask its pid)."""
        return self.slots[index].handle

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._stop_actors)

    def _stop_actors(self) -> None:
        """Close workers' environments and the environment servers (their sandboxes and snapshots), then kill every
        actor; shut Ray down only if this transport started it."""
        graceful = [s.handle.close.remote() for s in self.slots if s.handle is not None]
        graceful += [s.stop.remote() for s in self.env_servers]
        graceful += [e.close.remote() for e in self.engines]
        ray.wait(graceful, num_returns=len(graceful), timeout=60)
        for actor in [*(s.handle for s in self.slots if s.handle is not None), *self.env_servers, *self.engines]:
            ray.kill(actor, no_restart=True)
        if self.started_ray:
            ray.shutdown()

