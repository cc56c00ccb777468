"""The `Engine` seam: token ids in, token ids + per-token logprobs out.

Everything above this seam (agent loop, rollout server, trainer) works on token ids, never on re-tokenized
text: the ids a trajectory stores are exactly the ids the sampler produced, with the logprob the sampler
assigned to each. That is what importance-sampling corrections in the trainer need, and it avoids the
retokenization drift that breaks multi-turn RL in many frameworks.

Logprob convention (all engines): the log-probability of the sampled token under the distribution the
sampler drew from *before* top-p truncation, i.e. `log_softmax(logits / temperature)`; for greedy decoding
(temperature 0) it is `log_softmax(logits)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from shipyard.errors import UsageError

MIN_TEMPERATURE = 1e-4  # below this (but 0, greedy) logits / temperature overflows float32 to inf
MAX_SEED = 2**63 - 1  # seeds are in [0, MAX_SEED]; torch.Generator.manual_seed takes up to 2**64 - 1, so seed + k fits


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. Invalid values raise `UsageError` (a ValueError) here, at construction, so that no
    engine starts a batch with a request that would fail halfway (and take its batch-mates down with it)."""

    max_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise UsageError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also false for NaN
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise UsageError(f"seed must be in [0, 2**63 - 1], got {self.seed}")


@dataclass
class GenerationRequest:
    """One completion to sample. `cancelled`, when given, is polled between decode steps (so it must be cheap and
    thread-safe, e.g. an Event's `is_set`): once it returns True the engine stops this sequence and returns what it
    has with finish_reason "abort" — how a server stops the work of a client that has gone, or of its own shutdown."""

    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cancelled: Callable[[], bool] | None = None
    # The conversation this request continues (a rollout id): engines keep its KV cache between turns, and a router
    # sends every turn of one session to the same engine. None: a one-off request.
    session: str | None = None


class VersionConflict(ValueError):
    """A weight update whose version is not greater than the engine's `policy_version`."""


@dataclass
class Completion:
    """What the sampler produced. `token_ids` include the stop token when one ended the completion."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length", "abort"]  # abort: stopped by `GenerationRequest.cancelled`
    prompt_tokens: int
    policy_version: int = 0  # the version that sampled the first token (the oldest, when a completion spans updates)
    seconds: float = 0.0
    # Per sampled token, the policy version that drew it, when weights changed during this completion (an update
    # lands between decode steps); empty when every token is from `policy_version`.
    token_versions: list[int] = field(default_factory=list)


class Engine(Protocol):
    """An inference engine. `tokenizer` is the one the prompt ids were made with."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    policy_version: int

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Complete every request; the result list is in request order."""
        ...

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load new policy weights (a state dict) and tag later completions with `version`, which must be greater
        than `policy_version` (else `VersionConflict`: samples would be labelled with a version that goes backwards).
        All or nothing: on any error (stale version, unknown name, shape, dtype, a non-finite value) no weight and
        not the version has changed."""
        ...

    def close(self) -> None: ...


def stop_text_index(text: str, stops: tuple[str, ...]) -> int:
    """Index where the earliest stop string starts in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    return min(hits) if hits else -1
