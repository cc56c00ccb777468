"""`EngineRouter`: one `Engine` over several (engine actors, `shipyard serve` / vLLM / SGLang servers).

Routing follows the two rules that keep a fleet of caching engines busy:

* **Sticky sessions.** Every turn of a conversation (`GenerationRequest.session`, a rollout id) goes to the engine
  that served its previous turn: that engine holds its KV cache and prefills only the new tokens. Anywhere else the
  whole history is prefilled again.
* **Least loaded for new sessions.** A session's first request (and any request without a session) goes to the live
  engine with the fewest requests in flight through this router — a cheap, local signal that follows stragglers: an
  engine stuck on long generations accumulates in-flight requests and stops receiving new conversations.

**Failover.** Requests are token ids in, token ids out, with no server-side state a retry depends on (a lost cache
only costs a prefill), so an engine that raises `InfraError` (unreachable, 5xx, its actor died) is marked down for
`cooldown` seconds, its sessions are forgotten, and the request is retried on another engine. Only when no engine
is left does the router raise `InfraError` — which the episode turns into stop reason `infra_error`. Other errors
(a request the engine refuses) are the request's and propagate unchanged.

**Weights.** `update_weights` goes to every engine not already at that version, one after another; engines keep
serving meanwhile (a request in flight, or routed to an engine not yet reached, is drawn with the weights it had and
labelled so by its tokens' versions). An engine that misses a push — it fails with `InfraError` (a server restarting
or unreachable for a moment), or it is in cooldown and is skipped, so that a hung server cannot hold the push up for
the rest — is *behind*: it stays out of the rotation, beyond its cooldown, until its `policy_version` reaches the
version it missed (a later push, or a restart that loaded the latest weights). Its samples would not be mislabelled,
but they would be stale, and the scheduler rightly ends a run whose engines do not receive the weights; so the router
serves from the engines that have them. A push that leaves no engine at its version raises `NoEngineLeft`; any other
error of an engine's push (a rejected push) propagates at once and leaves the engines not yet reached as they were.
`policy_version` is the oldest version among the engines in rotation.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shipyard.models.engine import Completion, Engine, GenerationRequest
from shipyard.models.errors import InfraError

MAX_SESSIONS = 100_000  # sticky assignments remembered (least recently used forgotten first)


class NoEngineLeft(InfraError):
    """Every engine behind the router is down or behind the weights, or a push reached none."""


class EngineRouter:
    def __init__(self, engines: list[Engine], name: str | None = None, cooldown: float = 30.0,
                 max_concurrency: int = 256):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = list(engines)
        self.name = name or "router[" + ", ".join(e.name for e in engines) + "]"
        self.tokenizer = engines[0].tokenizer
        self.cooldown = cooldown
        self.inflight = [0] * len(engines)  # requests in flight through this router, per engine
        self.failures: list[str] = [""] * len(engines)  # the last InfraError of each engine
        self._down_until = [0.0] * len(engines)
        # per engine, the newest version pushed that it did not take; None until it misses one (an engine's initial
        # version is its own business: a replay engine's is -1)
        self.missed: list[int | None] = [None] * len(engines)
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="shipyard-router")

    @property
    def policy_version(self) -> int:
        current = [self.engines[i].policy_version for i in self._current()]
        return min(current) if current else min(e.policy_version for e in self.engines)

    def _behind(self, i: int) -> bool:
        """Whether engine `i` lacks a version it was pushed (it missed it, and nothing has loaded it since)."""
        return self.missed[i] is not None and self.engines[i].policy_version < self.missed[i]

    def _miss(self, i: int, version: int) -> None:
        self.missed[i] = version if self.missed[i] is None else max(self.missed[i], version)

    def _current(self) -> list[int]:
        return [i for i in range(len(self.engines)) if not self._behind(i)]

    def live(self) -> list[int]:
        """The engines requests go to: past their cooldown, and holding every version they were pushed."""
        now = time.monotonic()
        return [i for i in self._current() if self._down_until[i] <= now]

    def _pick(self, session: str | None) -> int:
        with self._lock:
            live = self.live()
            if not live:
                behind = ", ".join(f"{self.engines[i].name} missed version {self.missed[i]}"
                                   for i in range(len(self.engines)) if self._behind(i))
                raise NoEngineLeft(f"all {len(self.engines)} engines behind {self.name} are down or behind the weights "
                                   f"({self._causes()}{'; ' + behind if behind else ''})")
            if session is not None and (i := self._sessions.get(session)) is not None and i in live:
                self._sessions.move_to_end(session)
            else:
                i = min(live, key=lambda j: (self.inflight[j], j))
                if session is not None:
                    self._sessions[session] = i
                    while len(self._sessions) > MAX_SESSIONS:
                        self._sessions.popitem(last=False)
            self.inflight[i] += 1
            return i

    def _causes(self) -> str:
        return "; ".join(f"{e.name}: {c}" for e, c in zip(self.engines, self.failures, strict=True) if c) or \
            "no failure recorded"

    def _mark_down(self, i: int, error: InfraError) -> None:
        with self._lock:
            self._down_until[i] = time.monotonic() + self.cooldown
            self.failures[i] = f"{type(error).__name__}: {error}"
            for s in [s for s, j in self._sessions.items() if j == i]:
                del self._sessions[s]

    def route(self, request: GenerationRequest) -> Completion:
        """One request: sticky or least loaded, retried on another engine after an `InfraError`."""
        while True:
            i = self._pick(request.session)
            try:
                return self.engines[i].generate([request])[0]
            except InfraError as e:
                self._mark_down(i, e)
            finally:
                with self._lock:
                    self.inflight[i] -= 1

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        if len(requests) == 1:
            return [self.route(requests[0])]
        return [f.result() for f in [self.submit(r) for r in requests]]

    def submit(self, request: GenerationRequest) -> Future:
        return self._pool.submit(self.route, request)

    async def agenerate(self, request: GenerationRequest) -> Completion:
        return await asyncio.wrap_future(self.submit(request))

    def load(self) -> int:
        return sum(self.inflight)

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every engine below `version` loads the weights. One in cooldown is skipped, one that fails with
        `InfraError` is marked down: both serve nothing until they hold `version`. `NoEngineLeft` when no engine
        holds it afterwards."""
        for i, engine in enumerate(self.engines):
            if engine.policy_version >= version:
                continue
            if self._down_until[i] > time.monotonic():
                self._miss(i, version)
                continue
            try:
                engine.update_weights(version, tensors)
            except InfraError as e:
                self._miss(i, version)  # first: out of the rotation, whatever the cooldown
                self._mark_down(i, e)
        if all(e.policy_version < version for e in self.engines):
            raise NoEngineLeft(f"no engine behind {self.name} took weights version {version} ({self._causes()})")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for e in self.engines:
            e.close()
