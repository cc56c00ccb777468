"""The `Trajectory` record: everything an episode produced, in the form both users and the trainer need.

The token sequence of an episode is `prompt_ids`, then for every turn its sampled `completion_ids` followed
by its `observation_ids` (tool responses and the next assistant header, rendered by the harness). The loss
mask is 1 exactly on sampled tokens, so the trainer learns only from what the model chose; `logprobs` are the
sampler's, stored per sampled token, for importance-sampling corrections. The record is written as JSON after
every turn (atomically), so a crash loses at most the turn in flight, and `Trajectory.load` reads it back.

A failed call records why in `CallRecord.error_kind`, one word of `ERROR_KINDS` (the first problem found, in this
order of precedence):

- `untagged`: an attempted call written outside `<tool_call>` tags (bare or code-fenced JSON, a bare
  `<function=…>` block) under the parser setting `untagged="reject"`; it was not run;
- `truncated`: the call runs to the end of the turn without being closed (`</tool_call>`, `</function>` or the
  JSON's closing brace), typically cut by `max_new_tokens`;
- `malformed`: the call's text cannot be read as a call (invalid JSON, a body in neither form, a stray
  `</tool_call>`, a block left open before the next one);
- `unknown_tool`: it names no tool of this episode;
- `bad_arguments`: the arguments do not match the tool's JSON-Schema (missing, unexpected, mistyped);
- `rejected_edit`: an edit the syntax gate refused (it would have left a file that parsed unable to parse);
- `tool_error`: the tool ran and refused or failed otherwise (a missing file, an ambiguous edit, a timeout…).

Records written before `error_kind` existed load with `error_kind=None` (`shipyard.harness.validity` counts a
failed call without a kind as `unclassified`).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

ErrorKind = Literal["untagged", "truncated", "malformed", "unknown_tool", "bad_arguments", "rejected_edit",
                    "tool_error"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("untagged", "truncated", "malformed", "unknown_tool", "bad_arguments",
                                      "rejected_edit", "tool_error")
FORMAT_KINDS: tuple[ErrorKind, ...] = ("untagged", "truncated", "malformed", "unknown_tool")  # the wire format's


# What a repeated call's result ends with (`FirstCalls`).
REPEAT_NOTE = "[this call repeats your call of turn {turn}: the same tool with the same arguments]"


def call_key(name: str | None, arguments: dict[str, Any] | None) -> str:
    """A call's identity, tool and arguments: equal for a call repeated as it was (the arguments' order aside)."""
    return json.dumps([name, arguments], sort_keys=True, default=str)


class FirstCalls:
    """The turn in which each call of one conversation was first made, so that a call repeated as it was (same tool,
    same arguments; `call_key`) is answered with its result *and* a note naming that turn (`noted`). Small models
    loop — the bundled 0.5B repeated its previous turn's calls in 46 of 93 turns, the 1.5B read the same README 8
    times (issue 29) — and a model that is told can break the loop; the result itself still comes back (a test run
    repeated after an edit is no mistake). Turns count from 1, as the model reads them; a call repeated within its
    own turn is not noted (the turn's calls were written together). The agent loop and the chat API both use it, so
    training and serving show the same text."""

    def __init__(self) -> None:
        self._turns: dict[str, int] = {}

    def repeats(self, key: str, turn: int) -> int | None:
        """Record that turn `turn` makes the call `key`; the earliest earlier turn that made it, or None."""
        first = self._turns.setdefault(key, turn)
        return first if first < turn else None


def noted(output: str, first: int) -> str:
    """A repeated call's result, with the one-line note that it repeats turn `first`."""
    return output + ("" if output.endswith("\n") else "\n") + REPEAT_NOTE.format(turn=first)


@dataclass
class CallRecord:
    index: int
    name: str | None
    arguments: dict[str, Any] | None
    output: str
    error: str | None
    seconds: float
    untagged: bool = False  # written outside <tool_call> tags and accepted (parser setting untagged="accept")
    error_kind: ErrorKind | None = None  # why it failed (see the module docstring); None when it ran without error

    @property
    def key(self) -> str:
        """The call's identity (`call_key`)."""
        return call_key(self.name, self.arguments)


@dataclass
class Turn:
    index: int
    text: str
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    observation_ids: list[int]
    calls: list[CallRecord]
    parallel_width: int
    generate_seconds: float
    tools_seconds: float
    policy_version: int = 0  # the oldest version among this turn's tokens
    token_versions: list[int] = field(default_factory=list)  # per completion token, when they differ (else empty)

    @property
    def failed_calls(self) -> int:
        return sum(c.error is not None for c in self.calls)


@dataclass
class Trajectory:
    task: str
    model: str
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)
    stop_reason: str | None = None
    seconds: float = 0.0
    patch: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled over the episode (every turn's completion)."""
        return sum(len(t.completion_ids) for t in self.turns)

    # Flattened views for training -------------------------------------------------------------------------
    def token_ids(self) -> list[int]:
        ids = list(self.prompt_ids)
        for t in self.turns:
            ids += t.completion_ids + t.observation_ids
        return ids

    def loss_mask(self) -> list[int]:
        mask = [0] * len(self.prompt_ids)
        for t in self.turns:
            mask += [1] * len(t.completion_ids) + [0] * len(t.observation_ids)
        return mask

    def sampler_logprobs(self) -> list[float]:
        """Per-position sampler logprob (0.0 where the loss mask is 0)."""
        lps = [0.0] * len(self.prompt_ids)
        for t in self.turns:
            lps += list(t.logprobs) + [0.0] * len(t.observation_ids)
        return lps

    # Summary ----------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        calls = [c for t in self.turns for c in t.calls]
        widths = [t.parallel_width for t in self.turns if t.parallel_width]
        return {
            "turns": len(self.turns),
            "tool_calls": len(calls),
            "failed_calls": sum(c.error is not None for c in calls),
            "untagged_calls": sum(c.untagged for c in calls),
            "format_errors": sum(c.error_kind in FORMAT_KINDS for c in calls),
            "mean_parallel_width": sum(widths) / len(widths) if widths else 0.0,
            "sampled_tokens": self.sampled_tokens,
            "total_tokens": len(self.token_ids()),
            "seconds": round(self.seconds, 2),
            "stop_reason": self.stop_reason,
        }

    # Persistence ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(self.to_dict(), fh)
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """The trajectory a `to_dict` wrote; ValueError where its token views could not line up (`check_tokens`): a
        file read back may have been written by anyone."""
        turns = [Turn(**{**t, "calls": [CallRecord(**c) for c in t["calls"]]}) for t in data["turns"]]
        traj = cls(**{**data, "turns": turns})
        traj.check_tokens()
        return traj

    def check_tokens(self) -> None:
        """Raise ValueError unless every id list holds token ids (integers >= 0: a negative id indexes the embedding
        from its end, a float is truncated by torch) and each turn's logprobs (numbers) and token versions (when
        present) are one per completion token, as the flattened views and `Batch.from_trajectories` need."""
        def ids(value: Any, what: str) -> None:
            if not isinstance(value, list) or not all(type(i) is int and i >= 0 for i in value):
                raise ValueError(f"{what} is not a list of token ids (integers >= 0)")

        ids(self.prompt_ids, "prompt_ids")
        for t in self.turns:
            where = f"turn {t.index}"
            ids(t.completion_ids, f"{where}: completion_ids")
            ids(t.observation_ids, f"{where}: observation_ids")
            if not isinstance(t.logprobs, list) or len(t.logprobs) != len(t.completion_ids) or \
                    not all(type(x) in (int, float) for x in t.logprobs):
                raise ValueError(f"{where}: logprobs are not one number per completion token")
            if not isinstance(t.token_versions, list) or len(t.token_versions) not in (0, len(t.completion_ids)) or \
                    not all(type(v) is int for v in t.token_versions):
                raise ValueError(f"{where}: token_versions are not one integer per completion token (or none)")

    @classmethod
    def load(cls, path: str | Path) -> Trajectory:
        return cls.from_dict(json.loads(Path(path).read_text()))
