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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    """What the sampler produced. `token_ids` include the stop token when one ended the completion."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    policy_version: int = 0
    seconds: float = 0.0


class Engine(Protocol):
    """An inference engine. `tokenizer` is the one the prompt ids were made with."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    policy_version: int

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        """Complete every request; the result list is in request order."""
        ...

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load new policy weights (a full or partial state dict) and tag later completions with `version`."""
        ...

    def close(self) -> None: ...


def stop_text_index(text: str, stops: tuple[str, ...]) -> int:
    """Index where the earliest stop string starts in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    return min(hits) if hits else -1
