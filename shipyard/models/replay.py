"""`ReplayEngine`: replays recorded assistant messages instead of sampling — for debugging, tests and demos.

The file is JSON Lines, each line one JSON string: the full text of one assistant turn, tool-call blocks
included. Each request consumes the next message, which is tokenized (with the byte-level tokenizer unless
another is given) and ended with the stop token, exactly as if a model had sampled it. Logprobs are 0.0:
there was no sampler, and a replayed trajectory must never be mistaken for on-policy data
(`policy_version` is -1).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from shipyard.models.engine import Completion, GenerationRequest
from shipyard.models.errors import ReplayExhausted
from shipyard.models.tokenizer import byte_tokenizer


def load_replay(path: str | Path) -> list[str]:
    """Read a replay file, with line-numbered errors for anything that is not one JSON string per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"replay file {path} does not exist")
    messages = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            message = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg}); each line must be one JSON string "
                             'holding an assistant message, e.g. "I will read it.\\n<tool_call>…</tool_call>"') from e
        if not isinstance(message, str):
            raise ValueError(f"{path}:{number}: expected a JSON string, got {type(message).__name__}")
        messages.append(message)
    if not messages:
        raise ValueError(f"{path} holds no messages")
    return messages


class ReplayEngine:
    def __init__(self, messages: list[str], tokenizer: PreTrainedTokenizerBase | None = None, name: str = "replay"):
        self.messages = list(messages)
        self.tokenizer = tokenizer or byte_tokenizer()
        self.name = name
        self.policy_version = -1
        self._next = 0
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> ReplayEngine:
        return cls(load_replay(path), tokenizer, name=f"replay:{path}")

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        out = []
        for req in requests:
            with self._lock:
                if self._next >= len(self.messages):
                    raise ReplayExhausted(f"{self.name}: all {len(self.messages)} recorded messages were replayed "
                                          "and the agent asked for another; end the script with a message that "
                                          "makes no tool call")
                text = self.messages[self._next]
                self._next += 1
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            finish = "length" if len(ids) > req.sampling.max_tokens else "stop"
            ids = ids[: req.sampling.max_tokens]
            if finish == "stop" and req.sampling.stop_token_ids:
                ids.append(req.sampling.stop_token_ids[-1])
            out.append(Completion(ids, [0.0] * len(ids), self.tokenizer.decode(ids, skip_special_tokens=True),
                                  finish, len(req.prompt_ids), self.policy_version))
        return out

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        raise TypeError("a replay engine has no weights to update")

    def close(self) -> None:
        pass
