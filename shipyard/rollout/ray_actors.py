"""The Ray backend's actors: engines, rollout workers and environment servers, each a process of the cluster.

`RayTransport` (shipyard/rollout/ray_transport.py) starts them and talks to them; this module is what runs inside
them. It imports Ray at the top, so nothing imports it but the Ray transport (Ray is an optional extra).

- `EngineActor` holds one `Engine` built from a model name (`make_engine`) and serves `generate` from many rollout
  workers at once. For `vllm:MODEL` (a run's `engine.kind = "vllm"` with `[ray]`) that engine is a vLLM server the
  actor starts on its node, with the run's `[vllm]` settings and the GPUs Ray gave the actor, and stops with it; a
  push reaches the actor through the object store and is written to the server's node (`ManagedServer`, which also
  restarts a server that died, with the newest weights). Its default concurrency group has a thread per call in flight
  (`max_concurrency`), so a continuous-batching `LocalEngine` batches the decode steps of every rollout on the cluster
  that reached it. `load`, `cancel`, `describe` and `update_weights` run in a separate `control` group, so they are
  answered while every generation thread is busy. Its load is its own count of sequences in flight, which is what a
  router compares.
- `RayEngine` is the `Engine` a rollout worker uses for one engine actor: a request crosses the process boundary
  without its `cancelled` callback (a closure cannot be sent); the proxy polls the callback while it waits and
  tells the actor to abort those requests, which then end with finish reason "abort" as they would in-process.
  A dead or unreachable actor raises `EngineLost`, an `InfraError`, so the worker's `EngineRouter` marks that
  engine down and re-sends the request to another (token ids are stateless; only the KV cache is lost).
- `RolloutWorker` runs `run_episode` on threads (the actor's `max_concurrency`) over an `EngineRouter` of
  `RayEngine`s and an `Environment`: a `RemoteEnvironment` on the environment server of its own node, or, with no
  environment servers, a `LocalEnvironment` in the worker process.
- `EnvServerActor` runs the environment server's app under uvicorn on 127.0.0.1 of its node (a socket it bound
  itself, so no port race) with a fresh token, and hands the URL and token to the workers placed on that node.
  Loopback only: the server acts with its operator's privileges, and the workers that use it share its host.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from shipyard.models.errors import InfraError
from shipyard.rollout.record import EpisodeSpec, Rollout

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from shipyard.models.engine import Completion, GenerationRequest
    from shipyard.models.lora import LoraConfig
    from shipyard.models.vllm_server import VLLMConfig
    from shipyard.rollout.episode import EpisodeConfig

POLL = 0.1  # seconds between looks at a cancellation callback while a remote call runs
CONTROL_TIMEOUT = 30.0  # seconds a control call (load, describe) may take before its actor counts as lost


class EngineLost(InfraError):
    """An engine actor died or stopped answering. A router retries the request on another engine."""


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What a rollout worker needs to build a `RayEngine` without asking a possibly dead actor first."""

    handle: ray.actor.ActorHandle
    name: str
    tokenizer: PreTrainedTokenizerBase
    policy_version: int


@ray.remote(concurrency_groups={"control": 8})  # generate: the default group (max_concurrency)
class EngineActor:
    def __init__(self, model: str, device: str, tokenizer: str | None, lora: LoraConfig | None = None,
                 vllm: VLLMConfig | None = None):
        from shipyard.models.resolve import make_engine

        gpus = tuple(int(g) for g in ray.get_gpu_ids())
        if vllm is not None and gpus:  # its server runs on the GPUs Ray gave this actor (ray.engine_gpus)
            vllm = dataclasses.replace(vllm, gpus=gpus, gpus_per_server=len(gpus))
        # what loading and a server's restarts say, in the driver's output (Ray forwards the actor's stdout)
        self.engine = make_engine(model, device=device, tokenizer=tokenizer, lora=lora, vllm=vllm,
                                  status=lambda m: print(f"engine actor: {m}", flush=True))
        self._flags: dict[str, threading.Event] = {}
        self._in_flight = 0
        self._lock = threading.Lock()

    @ray.method(concurrency_group="control")
    def describe(self) -> tuple[str, PreTrainedTokenizerBase, int]:
        return self.engine.name, self.engine.tokenizer, self.engine.policy_version

    def generate(self, requests: list[GenerationRequest], ids: list[str]) -> list[Completion]:
        flags = [threading.Event() for _ in requests]
        with self._lock:
            self._flags.update(zip(ids, flags, strict=True))
            self._in_flight += len(requests)
        try:
            return self.engine.generate([dataclasses.replace(r, cancelled=f.is_set)
                                         for r, f in zip(requests, flags, strict=True)])
        finally:
            with self._lock:
                for i in ids:
                    self._flags.pop(i, None)
                self._in_flight -= len(requests)

    @ray.method(concurrency_group="control")
    def cancel(self, ids: list[str]) -> None:
        with self._lock:
            for i in ids:
                if i in self._flags:
                    self._flags[i].set()

    @ray.method(concurrency_group="control")
    def load(self) -> int:
        return self._in_flight

    @ray.method(concurrency_group="control")
    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> int:
        self.engine.update_weights(version, tensors)
        return self.engine.policy_version

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        self.engine.close()


class RayEngine:
    """The `Engine` protocol over one engine actor (see the module docstring). Closing it does nothing: the actor
    belongs to the transport, and other workers share it."""

    def __init__(self, info: EngineInfo):
        self.handle = info.handle
        self.name = info.name
        self.tokenizer = info.tokenizer
        self.policy_version = info.policy_version  # the newest version seen in a completion (informational)

    def _lost(self, error: Exception) -> EngineLost:
        return EngineLost(f"engine actor {self.name} is gone ({type(error).__name__}): {str(error).splitlines()[0]}")

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        ids = [uuid.uuid4().hex for _ in requests]
        ref = self.handle.generate.remote([dataclasses.replace(r, cancelled=None) for r in requests], ids)
        callbacks = [(i, r.cancelled) for i, r in zip(ids, requests, strict=True) if r.cancelled is not None]
        try:
            while callbacks and not ray.wait([ref], timeout=POLL)[0]:
                stopped = [i for i, cancelled in callbacks if cancelled()]
                if stopped:
                    self.handle.cancel.remote(stopped)
                    callbacks = [(i, c) for i, c in callbacks if i not in stopped]
            completions = ray.get(ref)
        except RayActorError as e:
            raise self._lost(e) from e
        self.policy_version = max([self.policy_version, *(c.policy_version for c in completions)])
        return completions

    def load(self) -> int:
        try:
            return ray.get(self.handle.load.remote(), timeout=CONTROL_TIMEOUT)
        except (RayActorError, GetTimeoutError) as e:
            raise self._lost(e) from e

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        try:
            self.policy_version = ray.get(self.handle.update_weights.remote(version, dict(tensors)))
        except RayActorError as e:
            raise self._lost(e) from e

    def close(self) -> None:
        pass


@ray.remote(concurrency_groups={"control": 2})
class RolloutWorker:
    def __init__(self, label: str, engines: list[EngineInfo], env_address: tuple[str, str] | None,
                 config: EpisodeConfig):
        from shipyard.models.router import EngineRouter

        self.label, self.config = label, config
        self.engine = EngineRouter([RayEngine(info) for info in engines])
        if env_address is None:
            from shipyard.rollout.environment import LocalEnvironment

            self.env = LocalEnvironment()
        else:
            from shipyard.rollout.remote import RemoteEnvironment
            from shipyard.sandbox.client import EnvClient

            url, token = env_address
            self.env = RemoteEnvironment(EnvClient(url, token=token))
        self._cancel: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    @ray.method(concurrency_group="control")
    def ready(self) -> int:
        return os.getpid()

    def run(self, spec: EpisodeSpec) -> Rollout:
        from shipyard.rollout.episode import run_episode

        flag = threading.Event()
        with self._lock:
            self._cancel[spec.rollout_id] = flag
        try:
            rollout = run_episode(spec, self.engine, self.env, self.config, cancelled=flag.is_set)
        finally:
            with self._lock:
                self._cancel.pop(spec.rollout_id, None)
        rollout.worker = self.label
        return rollout

    @ray.method(concurrency_group="control")
    def cancel(self, rollout_id: str) -> None:
        with self._lock:
            if rollout_id in self._cancel:
                self._cancel[rollout_id].set()

    @ray.method(concurrency_group="control")
    def close(self) -> None:
        self.engine.close()  # the router's threads; its RayEngines leave their actors to the transport
        self.env.close()


@ray.remote
class EnvServerActor:
    def __init__(self, allowed_roots: tuple[Path, ...], startup: float = 60.0):
        import uvicorn

        from shipyard import httpguard
        from shipyard.sandbox.server import ServerConfig, create_app

        self.token = httpguard.new_token()
        app = create_app(ServerConfig(token=self.token, allowed_roots=tuple(allowed_roots)))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError(f"the environment server did not start on {self.url} within {startup} s")

    def address(self) -> tuple[str, str, str]:
        """(URL, token, the node it runs on): workers on that node use it."""
        return self.url, self.token, ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        """Stop serving; the app's shutdown closes every sandbox and snapshot it made."""
        self.server.should_exit = True
        self.thread.join(timeout=60)
