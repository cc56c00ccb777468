"""Parse a model turn into tool calls — never raising, always saying precisely what was wrong.

A turn may hold any number of `<tool_call>…</tool_call>` blocks; several blocks in one turn are parallel
calls. Two body forms are accepted, because open models are trained on both:

* JSON (Hermes / Qwen2.5): `{"name": "read_file", "arguments": {"path": "a.py"}}`; `arguments` may also be a
  JSON string holding the object (the OpenAI API encodes it that way).
* XML parameters (Qwen3-Coder style): `<function=write_file><parameter=path>a.py</parameter>
  <parameter=content>…raw text, no escaping…</parameter></function>`. Values are raw text; for parameters
  whose schema type is not a string the value is read as JSON (`5`, `true`, `["a.py"]`).

Every block becomes a `ToolCall`; a block that cannot be used carries an `error` addressed to the model: which
call (1-based, in turn order), what is wrong, and the list of tools or the expected signature. Arguments are
validated against the tool's JSON-Schema (missing, unexpected and mistyped arguments are all reported). JSON
that Python's decoder refuses beyond syntax (integers of more than 4300 digits, nesting deeper than the recursion
limit) is reported the same way, and a number given for an `integer` argument reaches the tool as an `int`
(JSON Schema counts `2.0` and `1e300` as integers; Python's `range` does not).

Deliberate harness decision (training and production must parse identically, so this is a setting that
both read from one config and that every trajectory records): by default only tagged blocks are calls. A turn
with no `<tool_call>` block is the model's final answer — *unless* it holds something that is plainly an
attempted call in the wrong wrapper (a JSON object naming one of our tools, bare or in a code fence, or a bare
`<function=…>` block). With `untagged="reject"` (the default) those are not executed but reported as format
errors, so the model (and RL) learns the format. With `untagged="accept"` they run as calls, marked
`untagged=True`, so a reward can still penalise the format while the policy is useful from step one. This
exists for small models: the bundled Qwen2.5-Coder-0.5B wrote bare JSON calls in 24 of 24 first turns and
tagged ones in none (docs/harness.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft202012Validator

from shipyard.harness.tools.base import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_RE = re.compile(r"<function=([^>\s]*)>(.*?)(</function>|\Z)", re.DOTALL)
PARAM_RE = re.compile(r"<parameter=([^>\s]*)>(.*?)</parameter>", re.DOTALL)
MAX_NEAR_MISS_TRIES = 256  # '{' positions tried as the start of a bare JSON call


@dataclass
class ToolCall:
    """One call as parsed from the model. `error` set means it will not run; the error is the tool response."""

    index: int
    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None
    untagged: bool = False


@dataclass
class ParsedTurn:
    """The text outside the call blocks, and the calls (valid and invalid) in turn order."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def is_final(self) -> bool:
        """A turn with nothing that looks like a call is the model's final answer."""
        return not self.calls

    @property
    def valid_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if c.error is None]


def signature(tool: Tool) -> str:
    """A compact signature for error messages: `read_file(path: string, offset?: integer, limit?: integer)`."""
    props, required = tool.parameters.get("properties", {}), set(tool.parameters.get("required", []))
    args = [f"{k}{'' if k in required else '?'}: {v.get('type', 'any')}" for k, v in props.items()]
    return f"{tool.name}({', '.join(args)})"


class ToolCallParser:
    """Parses turns against a fixed tool set (validators are compiled once)."""

    def __init__(self, tools: list[Tool], untagged: Literal["reject", "accept"] = "reject"):
        if untagged not in ("reject", "accept"):
            raise ValueError(f"untagged must be 'reject' or 'accept', got {untagged!r}")
        self.untagged = untagged
        self.tools: Mapping[str, Tool] = {t.name: t for t in tools}
        self._validators = {t.name: Draft202012Validator(t.parameters) for t in tools}

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        outside: list[str] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            stray = text.find(CLOSE, pos)
            if stray != -1 and (start == -1 or stray < start):
                outside.append(text[pos:stray])
                calls.append(ToolCall(len(calls), None, None, CLOSE,
                                      f"tool call #{len(calls) + 1}: found {CLOSE} without a matching {OPEN}."))
                pos = stray + len(CLOSE)
                continue
            if start == -1:
                outside.append(text[pos:])
                break
            outside.append(text[pos:start])
            body_start = start + len(OPEN)
            end = text.find(CLOSE, body_start)
            next_open = text.find(OPEN, body_start)
            if end == -1 or (next_open != -1 and next_open < end):
                stop = len(text) if next_open == -1 else next_open
                raw = text[start:stop]
                calls.append(ToolCall(len(calls), None, None, raw,
                                      f"tool call #{len(calls) + 1} is not closed with {CLOSE}; "
                                      "every call must be wrapped as <tool_call>…</tool_call>."))
                pos = stop
                continue
            calls.append(self._parse_body(len(calls), text[body_start:end], text[start:end + len(CLOSE)]))
            pos = end + len(CLOSE)
        content = "".join(outside).strip()
        if not calls:
            calls = self._near_misses(content)
        return ParsedTurn(content, calls)

    def _parse_body(self, index: int, body: str, raw: str) -> ToolCall:
        body = body.strip()
        label = f"tool call #{index + 1}"
        if body.startswith("{"):
            name, args, error = self._parse_json(body)
        elif body.startswith("<function="):
            name, args, error = self._parse_xml(body)
        else:
            name, args = None, None
            error = ('its body must be a JSON object {"name": <tool>, "arguments": {…}} or a '
                     "<function=NAME><parameter=KEY>VALUE</parameter></function> block")
        if error is None and _lone_surrogate([name, args]):
            name, args, error = None, None, ("a string holds a lone surrogate escape (such as \\ud800), which is not "
                                             "text; write plain UTF-8")
        if error is None:
            error = self._validate(name, args)
        if error is None and args:
            props = self.tools[name].parameters.get("properties", {})
            for key, value in args.items():
                if props.get(key, {}).get("type") == "integer" and isinstance(value, float):
                    args[key] = int(value)  # integral: validation passed
        return ToolCall(index, name, args, raw, f"{label}{f' ({name})' if name else ''}: {error}" if error else None)

    def _parse_json(self, body: str) -> tuple[str | None, dict | None, str | None]:
        try:
            obj, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as e:
            return None, None, f"invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        except (ValueError, RecursionError) as e:
            return None, None, _unreadable(e)
        if body[end:].strip():
            return None, None, f"unexpected text after the JSON object: {body[end:].strip()[:60]!r}"
        if not isinstance(obj, dict):
            return None, None, "the JSON must be an object with keys 'name' and 'arguments'"
        extra = set(obj) - {"name", "arguments"}
        if extra:
            return None, None, f"unexpected keys {sorted(extra)}; only 'name' and 'arguments' are allowed"
        name, args = obj.get("name"), obj.get("arguments", {})
        if not isinstance(name, str) or not name:
            return None, None, "'name' must be a non-empty string naming a tool"
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return name, None, "'arguments' is a string that is not valid JSON; give it as a JSON object"
            except (ValueError, RecursionError) as e:
                return name, None, _unreadable(e)
        if not isinstance(args, dict):
            return name, None, f"'arguments' must be a JSON object, not {type(args).__name__}"
        return name, args, None

    def _parse_xml(self, body: str) -> tuple[str | None, dict | None, str | None]:
        m = FUNCTION_RE.fullmatch(body)
        if m is None:
            return None, None, "text after </function>; put each call in its own <tool_call> block"
        name, inner, closing = m.group(1), m.group(2), m.group(3)
        if not closing:
            return name or None, None, "the <function=…> block is not closed with </function>"
        if not name:
            return None, None, "<function=> is missing the tool name"
        args: dict[str, Any] = {}
        leftover = PARAM_RE.sub("", inner).strip()
        if leftover:
            return name, None, (f"unexpected text inside <function={name}>: {leftover[:60]!r}; each argument "
                                "must be <parameter=KEY>VALUE</parameter>")
        props = self.tools[name].parameters.get("properties", {}) if name in self.tools else {}
        for key, value in PARAM_RE.findall(inner):
            if key in args:
                return name, None, f"parameter '{key}' is given twice"
            value = value.removeprefix("\n").removesuffix("\n")
            args[key] = _coerce(value, props.get(key, {}).get("type", "string"))
        return name, args, None

    def _validate(self, name: str | None, args: dict | None) -> str | None:
        if name not in self.tools:
            return f"unknown tool '{name}'. Available tools: {', '.join(self.tools)}."
        try:
            errors = sorted(self._validators[name].iter_errors(args), key=lambda e: list(e.path))
            if not errors:
                return None
            problems = []
            for e in errors[:10]:
                where = "arguments" + "".join(f"[{p!r}]" for p in e.path)
                message = e.message if len(e.message) <= 300 else f"{e.message[:200]}…{e.message[-80:]}"
                problems.append(f"{where[:200]}: {message}")
        except RecursionError:
            return f"the arguments are nested too deeply. Expected {signature(self.tools[name])}."
        return f"invalid arguments — {'; '.join(problems)}. Expected {signature(self.tools[name])}."

    def _near_misses(self, content: str) -> list[ToolCall]:
        """Calls written outside <tool_call> tags: reported, never executed (see module docstring)."""
        found: list[str] = []
        decoder, pos, tries = json.JSONDecoder(), content.find("{"), 0
        while pos != -1 and len(found) < 16 and tries < MAX_NEAR_MISS_TRIES:
            tries += 1
            try:
                obj, end = decoder.raw_decode(content, pos)
            except (ValueError, RecursionError):  # not JSON, or JSON Python will not decode (5000-digit numbers)
                pos = content.find("{", pos + 1)
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"] in self.tools:
                found.append(content[pos:end])
            pos = content.find("{", end)
        found += [m.group(0) for m in FUNCTION_RE.finditer(content)]
        if self.untagged == "accept":
            calls = [self._parse_body(i, raw, raw) for i, raw in enumerate(found)]
            for call in calls:
                call.untagged = True
            return calls
        return [ToolCall(i, None, None, raw,
                         f"tool call #{i + 1} was not executed: it is not wrapped in {OPEN}…{CLOSE} tags. Write "
                         f'{OPEN}\n{{"name": "…", "arguments": {{…}}}}\n{CLOSE} (no code fences).')
                for i, raw in enumerate(found)]


def _lone_surrogate(value: Any) -> bool:
    """Whether a decoded JSON value holds a lone surrogate anywhere (JSON's `\\ud800` decodes to one; no file name,
    process argument, tokenizer or terminal takes it)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
    return False


def _unreadable(e: Exception) -> str:
    if isinstance(e, RecursionError):
        return "the JSON is nested too deeply"
    return f"a value in the JSON cannot be used ({str(e)[:120]}); numbers must have at most 4300 digits"


def _coerce(value: str, schema_type: str) -> Any:
    if schema_type == "string":
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError, as is a 5000-digit integer
        return value  # left as text; schema validation then reports the type mismatch precisely
