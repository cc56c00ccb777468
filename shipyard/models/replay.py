"""`ReplayEngine`: replays recorded assistant messages instead of sampling — for debugging, tests, demos and eval.

A replay file is JSON Lines. A line is either

* a JSON string: the full text of one assistant turn, tool-call blocks included. The string lines, in order, are
  the file's **default script**; or
* a JSON object `{"task": ID, "messages": ["…", "…"]}`: the **script of task ID** (keyed scripts; a file written by
  `shipyard.rollout.gold.write_gold_replay` holds one per task, so one replay engine serves a whole task set).

Each conversation replays its script from the start. A conversation is a request's `session` (the rollout id, see
`shipyard.rollout.record`: `"<group id>/<index>[~attempt]"`; the scheduler's group ids are the task id, `@` and the
group's number or `eval`, e.g. `"add-roman@eval/0~1"`); requests without a session share one conversation, so a
single agent run (the CLI) consumes the default script line by line, as it always has. A session's request whose
prompt does not extend the session's last prompt begins its next conversation — a periodic evaluation reruns the
same rollout ids — and replays the script from the start again. A keyed script is chosen by
the task id the session begins with: the longest script key that is the whole session or is followed in it by a
character no task id holds (anything but letters, digits, `.`, `_` and `-`; `session_task`). A session no keyed
script matches replays the default script, and with no default script it is an error (`ReplayExhausted`) that
names the session.

Each request consumes its conversation's next message, which is tokenized (with the byte-level tokenizer unless
another is given) and ended with the stop token, exactly as if a model had sampled it. Logprobs are 0.0: there was
no sampler, and a replayed trajectory must never be mistaken for on-policy data (`policy_version` is -1).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from array import array
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from shipyard.errors import FileFormatError, InputNotFound
from shipyard.models.engine import Completion, GenerationRequest, VersionConflict
from shipyard.models.errors import ReplayExhausted
from shipyard.models.tokenizer import byte_tokenizer

TASK_ID_CHAR = re.compile(r"[A-Za-z0-9._-]")  # the characters of a task id (shipyard.sandbox.snapshot.NAME_RE)
EXAMPLE_LINE = '"I will read it.\\n<tool_call>…</tool_call>"'


def session_task(session: str, keys: Mapping[str, object] | set[str]) -> str | None:
    """The key of `keys` that `session` (a rollout id) belongs to: the longest key that is the whole session or is
    followed by a character no task id holds; None when none is."""
    best = None
    for key in keys:
        ends = len(session) == len(key) or not TASK_ID_CHAR.fullmatch(session[len(key):len(key) + 1])
        if session.startswith(key) and ends and (best is None or len(key) > len(best)):
            best = key
    return best


def _keyed(path: Path, number: int, obj: dict) -> tuple[str, list[str]]:
    where = f"{path}:{number}"
    if set(obj) != {"task", "messages"}:
        keys = ", ".join(map(repr, sorted(obj))) or "none"
        raise FileFormatError(f'{where}: expected a JSON string (an assistant message) or a keyed script '
                              f'{{"task": ID, "messages": [...]}}; this object has the keys {keys}')
    task, messages = obj["task"], obj["messages"]
    if not isinstance(task, str) or not task:
        raise FileFormatError(f"{where}: 'task' must be a non-empty string")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, str) for m in messages):
        raise FileFormatError(f"{where}: 'messages' must be a non-empty list of strings (assistant turns)")
    return task, messages


def load_scripts(path: str | Path) -> tuple[list[str], dict[str, list[str]]]:
    """(default script, keyed scripts by task id) of a replay file, with line-numbered errors."""
    path = Path(path)
    if not path.is_file():
        raise InputNotFound(f"replay file {path} does not exist")
    default: list[str] = []
    keyed: dict[str, list[str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise FileFormatError(f"{path}:{number}: not valid JSON ({why}); each line must be one JSON string "
                                  f"holding an assistant message, e.g. {EXAMPLE_LINE}, or "
                                  '{"task": ID, "messages": [...]}') from e
        if isinstance(item, str):
            default.append(item)
        elif isinstance(item, dict):
            task, messages = _keyed(path, number, item)
            if task in keyed:
                raise FileFormatError(f"{path}:{number}: a second script for task {task!r}")
            keyed[task] = messages
        else:
            raise FileFormatError(f"{path}:{number}: expected a JSON string (an assistant message) or an object "
                                  f'{{"task": ID, "messages": [...]}}, got {type(item).__name__}')
    if not default and not keyed:
        raise FileFormatError(f"{path} holds no messages")
    return default, keyed


def load_replay(path: str | Path) -> list[str]:
    """The default script of a replay file (one JSON string per line); keyed scripts are refused here."""
    default, keyed = load_scripts(path)
    if keyed:
        raise ValueError(f"{path} holds keyed scripts; read it with load_scripts")
    return default


def _digest(ids: list[int]) -> bytes:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


class ReplayEngine:
    def __init__(self, messages: list[str] | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 name: str = "replay", scripts: Mapping[str, list[str]] | None = None,
                 encode: Callable[[str], list[int]] | None = None):
        self.messages = list(messages or [])
        self.scripts = {task: list(script) for task, script in (scripts or {}).items()}
        if not self.messages and not self.scripts:
            raise ValueError("a replay engine needs messages or keyed scripts")
        self.tokenizer = tokenizer or byte_tokenizer()
        # a message's ids: as the policy would write it (`ChatFormat.completion_ids`: its wire's call tags) when given
        self.encode = encode or (lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        self.name = name
        self.policy_version = -1
        self.pushed_version = -1
        self._cursors: dict[str | None, int] = {}  # conversation -> index of its next message
        self._prompts: dict[str, tuple[int, bytes]] = {}  # session -> its last prompt's length and digest
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> ReplayEngine:
        default, keyed = load_scripts(path)
        return cls(default, tokenizer, name=f"replay:{path}", scripts=keyed)

    def script(self, session: str | None) -> tuple[str | None, list[str]]:
        """(the task whose keyed script the conversation replays, or None for the default script; that script)."""
        task = session_task(session, self.scripts) if session is not None else None
        if task is not None:
            return task, self.scripts[task]
        if not self.messages:
            raise ReplayExhausted(f"{self.name} has no script for session {session!r}: its keyed scripts are for "
                                  f"{', '.join(sorted(self.scripts)[:10])}{' …' if len(self.scripts) > 10 else ''}, "
                                  "and it has no default script (lines that are JSON strings)")
        return None, self.messages

    def _next_message(self, session: str | None, prompt_ids: list[int]) -> str:
        task, script = self.script(session)
        with self._lock:
            index = self._cursors.get(session, 0)
            if session is not None:
                # A conversation's next prompt extends its last one; one that does not is the session's next
                # conversation (a periodic eval reruns its rollout ids): replayed from the start again.
                seen = self._prompts.get(session)
                if seen is not None and not (len(prompt_ids) > seen[0] and _digest(prompt_ids[:seen[0]]) == seen[1]):
                    index = 0
                self._prompts[session] = (len(prompt_ids), _digest(prompt_ids))
            if index >= len(script):
                which = f"task {task!r}'s script" if task is not None else "the script"
                raise ReplayExhausted(f"{self.name}: all {len(script)} recorded messages were replayed ({which}) "
                                      "and the agent asked for another; end the script with a message that makes no "
                                      "tool call")
            self._cursors[session] = index + 1
        return script[index]

    def generate(self, requests: list[GenerationRequest]) -> list[Completion]:
        out = []
        for req in requests:
            text = self._next_message(req.session, req.prompt_ids)
            ids = self.encode(text)
            finish = "length" if len(ids) > req.sampling.max_tokens else "stop"
            ids = ids[: req.sampling.max_tokens]
            if finish == "stop" and req.sampling.stop_token_ids:
                ids.append(req.sampling.stop_token_ids[-1])
            out.append(Completion(ids, [0.0] * len(ids), self.tokenizer.decode(ids, skip_special_tokens=True),
                                  finish, len(req.prompt_ids), self.policy_version))
        return out

    def longest(self) -> int:
        """Tokens in the longest recorded message (a turn's token budget must be at least this to replay it whole)."""
        scripts = [self.messages, *self.scripts.values()]
        return max((len(self.encode(m)) for s in scripts for m in s), default=0)

    def update_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """A replay engine has no weights: a push (`shipyard train` with `engine.kind = "replay:…"`, a scripted
        sampler for tests and demos of the loop) changes nothing but the last pushed version, which must grow
        (`VersionConflict`). Its samples keep policy version -1, so the trainer's staleness bound decides how many
        steps may use them (`rollout.max_staleness`); they are never taken for on-policy data."""
        if version <= self.pushed_version:
            raise VersionConflict(f"weights of version {version} pushed after version {self.pushed_version}")
        self.pushed_version = version

    def close(self) -> None:
        pass
