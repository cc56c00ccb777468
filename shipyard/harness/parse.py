"""Parse a model turn into tool calls — never raising, always saying precisely what was wrong.

A turn may hold any number of `<tool_call>…</tool_call>` blocks; several blocks in one turn are parallel
calls. Two body forms are accepted, because open models are trained on both:

* JSON (Hermes / Qwen2.5): `{"name": "read_file", "arguments": {"path": "a.py"}}`; `arguments` may also be a
  JSON string holding the object (the OpenAI API encodes it that way).
* XML parameters (Qwen3-Coder style): `<function=write_file><parameter=path>a.py</parameter>
  <parameter=content>…raw text, no escaping…</parameter></function>`. Values are raw text; for parameters
  whose schema type is not a string the value is read as JSON (`5`, `true`, `["a.py"]`).

Every block becomes a `ToolCall`; a block that cannot be used carries an `error` addressed to the model — which
call (1-based, in turn order), what is wrong — and an `error_kind` (`shipyard.harness.trajectory.ERROR_KINDS`). The
turn's first format error (untagged, truncated, malformed, unknown tool) also shows the expected format with one
example and the tool list, once per turn. Arguments are validated against the tool's JSON-Schema (missing,
unexpected and mistyped arguments are all reported, with the tool's signature). JSON that Python's decoder refuses
beyond syntax (integers of more than 4300 digits, nesting deeper than the recursion limit) is reported the same way,
and a number given for an `integer` argument reaches the tool as an `int` (JSON Schema counts `2.0` and `1e300` as
integers; Python's `range` does not).

**Attempted calls.** Only a turn with no *attempted* call is the model's final answer; every attempted call gets a
response, so a model that got the format wrong is told so and the episode goes on (before, many ended the episode
as if they were the answer). An attempted call is:

* a `<tool_call>` block, closed or not (one the turn ends inside is `truncated`), or a stray `</tool_call>`;
* a turn that ends inside the tag itself (`…<tool_c`, at least `<tool`): `truncated`;
* outside the tags (bare, or in a code fence), a JSON object — or a Python-literal / cut-off / otherwise
  undecodable object whose head is `{"name": "…"` — that either names one of our tools (anywhere in the text,
  nested in another object included, e.g. OpenAI's `{"type": "function", "function": {…}}`), or has the call's
  shape `{"name": NAME, "arguments": {…} or "…"}` with an identifier-like NAME *and stands on its own lines*
  (nothing before it on its line but indentation or a code-fence opener; nothing after it but a fence);
* a bare `<function=…>` block.

The own-lines rule is what keeps prose and code from becoming false calls: `the config is {"name": "demo"}`, a
Python `payload = {"name": "x", "arguments": {}}` or a JSON list of records mentioning `"arguments"` are text.

Deliberate harness decision (training and production must parse identically, so this is a setting that both read
from one config and that every trajectory records): by default only tagged blocks are calls. With
`untagged="reject"` (the default) calls outside the tags are not executed but reported as format errors
(`untagged`, naming any further problem too), so the model (and RL) learns the format. With `untagged="accept"`
they are parsed as calls, marked `untagged=True` (an accepted untagged call runs; a broken one gets its own kind),
so a reward can still penalise the format while the policy is useful from step one. This exists for small models:
the bundled Qwen2.5-Coder-0.5B wrote bare JSON calls in 24 of 24 first turns and tagged ones in none
(docs/harness.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft202012Validator

from shipyard.harness.tools.base import Tool
from shipyard.harness.trajectory import FORMAT_KINDS, ErrorKind

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_RE = re.compile(r"<function=([^>\s]*)>(.*?)(</function>|\Z)", re.DOTALL)
PARAM_RE = re.compile(r"<parameter=([^>\s]*)>(.*?)</parameter>", re.DOTALL)
MAX_NEAR_MISS_TRIES = 256  # '{' positions tried as the start of a bare JSON call
MIN_CUT_OPENER = 5  # "<tool": the shortest end of a turn read as a <tool_call> tag cut off mid-way
# The head of a call object, JSON or a Python literal: {"name": "NAME" and, when present, , "arguments":
CALL_HEAD = re.compile(r"""\{\s*(["'])name\1\s*:\s*(["'])([A-Za-z_][\w.\-]{0,63})\2\s*(,\s*(["'])arguments\5\s*:)?""")
TOOL_NAME = re.compile(r"[A-Za-z_][\w.\-]{0,63}")
FENCE = "```"
FENCE_OPENER = re.compile(r"\s*(```[\w+.-]*\s*)?")  # what may precede a call on its line: indentation, a fence


@dataclass
class ToolCall:
    """One call as parsed from the model. `error` set means it will not run; the error is the tool response."""

    index: int
    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None
    untagged: bool = False
    error_kind: ErrorKind | None = None  # see shipyard.harness.trajectory.ERROR_KINDS


@dataclass
class ParsedTurn:
    """The text outside the call blocks, and the calls (valid and invalid) in turn order."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def is_final(self) -> bool:
        """A turn without an attempted call (see the module docstring) is the model's final answer."""
        return not self.calls

    @property
    def valid_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if c.error is None]


def signature(tool: Tool) -> str:
    """A compact signature for error messages: `read_file(path: string, offset?: integer, limit?: integer)`."""
    props, required = tool.parameters.get("properties", {}), set(tool.parameters.get("required", []))
    args = [f"{k}{'' if k in required else '?'}: {v.get('type', 'any')}" for k, v in props.items()]
    return f"{tool.name}({', '.join(args)})"


class _Unusable(Exception):
    """Why a call's text cannot be run: an error kind and a message for the model (internal to the parser)."""

    def __init__(self, kind: ErrorKind, message: str, name: str | None = None,
                 arguments: dict[str, Any] | None = None):
        super().__init__(message)
        self.kind, self.message, self.name, self.arguments = kind, message, name, arguments


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
                calls.append(_failed(len(calls), CLOSE, "malformed", f"found {CLOSE} without a matching {OPEN}."))
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
                where = "the turn ended inside it" if next_open == -1 else f"another {OPEN} began inside it"
                calls.append(_failed(len(calls), text[start:stop], "truncated" if next_open == -1 else "malformed",
                                     f"it is not closed with {CLOSE} ({where}); every call must be wrapped as "
                                     f"{OPEN}…{CLOSE}."))
                pos = stop
                continue
            calls.append(self._parse_body(len(calls), text[body_start:end], text[start:end + len(CLOSE)]))
            pos = end + len(CLOSE)
        cut = _cut_opener(outside[-1])
        if cut:
            outside[-1] = outside[-1].rstrip()[:-len(cut)]
        content = "".join(outside).strip()
        if not calls:
            calls = self._near_misses(content)
        if cut:
            calls.append(_failed(len(calls), cut, "truncated", f"the turn ended inside the tag {cut!r}; write the "
                                 f"whole {OPEN} tag, the call, then {CLOSE}."))
        self._add_help(calls)
        return ParsedTurn(content, calls)

    def _parse_body(self, index: int, body: str, raw: str, at_end: bool = False) -> ToolCall:
        """One call's body; `at_end`: it runs to the end of the turn unclosed, so a cut-off body is `truncated`."""
        try:
            name, args = self._read(body, at_end)
        except _Unusable as e:
            label = f"tool call #{index + 1}{f' ({e.name})' if e.name else ''}"
            return ToolCall(index, e.name, e.arguments, raw, f"{label}: {e.message}", error_kind=e.kind)
        return ToolCall(index, name, args, raw)

    def _read(self, body: str, at_end: bool) -> tuple[str, dict[str, Any]]:
        body = body.strip()
        if body.startswith("{"):
            name, args = self._parse_json(body, at_end)
        elif body.startswith("<function="):
            name, args = self._parse_xml(body, at_end)
        else:
            raise _Unusable("malformed", 'its body must be a JSON object {"name": <tool>, "arguments": {…}} or a '
                                         "<function=NAME><parameter=KEY>VALUE</parameter></function> block")
        if _lone_surrogate([name, args]):
            raise _Unusable("bad_arguments", "a string holds a lone surrogate escape (such as \\ud800), which is not "
                                             "text; write plain UTF-8")
        self._validate(name, args)
        props = self.tools[name].parameters.get("properties", {})
        for key, value in args.items():
            if props.get(key, {}).get("type") == "integer" and isinstance(value, float):
                args[key] = int(value)  # integral: validation passed
        return name, args

    def _parse_json(self, body: str, at_end: bool) -> tuple[str, dict[str, Any]]:
        try:
            obj, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError as e:
            if at_end and _unclosed(body):
                raise _Unusable("truncated", "the JSON ends before it is complete (the turn ended inside it)") from None
            raise _Unusable("malformed", f"invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        except (ValueError, RecursionError) as e:
            raise _Unusable("malformed", _unreadable(e)) from None
        if body[end:].strip():
            raise _Unusable("malformed", f"unexpected text after the JSON object: {body[end:].strip()[:60]!r}")
        if not isinstance(obj, dict):
            raise _Unusable("malformed", "the JSON must be an object with keys 'name' and 'arguments'")
        extra = set(obj) - {"name", "arguments"}
        if extra:
            raise _Unusable("malformed", f"unexpected keys {sorted(extra)}; only 'name' and 'arguments' are allowed")
        name, args = obj.get("name"), obj.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise _Unusable("malformed", "'name' must be a non-empty string naming a tool")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise _Unusable("malformed", "'arguments' is a string that is not valid JSON; give it as a JSON "
                                             "object", name) from None
            except (ValueError, RecursionError) as e:
                raise _Unusable("malformed", _unreadable(e), name) from None
        if not isinstance(args, dict):
            raise _Unusable("malformed", f"'arguments' must be a JSON object, not {type(args).__name__}", name)
        return name, args

    def _parse_xml(self, body: str, at_end: bool) -> tuple[str, dict[str, Any]]:
        m = FUNCTION_RE.fullmatch(body)
        if m is None:
            raise _Unusable("malformed", "text after </function>; put each call in its own <tool_call> block")
        name, inner, closing = m.group(1), m.group(2), m.group(3)
        if not closing:
            raise _Unusable("truncated" if at_end else "malformed", "the <function=…> block is not closed with "
                            "</function>" + (" (the turn ended inside it)" if at_end else ""), name or None)
        if not name:
            raise _Unusable("malformed", "<function=> is missing the tool name")
        args: dict[str, Any] = {}
        leftover = PARAM_RE.sub("", inner).strip()
        if leftover:
            raise _Unusable("malformed", f"unexpected text inside <function={name}>: {leftover[:60]!r}; each "
                                         "argument must be <parameter=KEY>VALUE</parameter>", name)
        props = self.tools[name].parameters.get("properties", {}) if name in self.tools else {}
        for key, value in PARAM_RE.findall(inner):
            if key in args:
                raise _Unusable("bad_arguments", f"parameter '{key}' is given twice", name)
            value = value.removeprefix("\n").removesuffix("\n")
            args[key] = _coerce(value, props.get(key, {}).get("type", "string"))
        return name, args

    def _validate(self, name: str, args: dict[str, Any]) -> None:
        if name not in self.tools:
            raise _Unusable("unknown_tool", f"unknown tool '{name}'. Available tools: {', '.join(self.tools)}.", name)
        try:
            errors = sorted(self._validators[name].iter_errors(args), key=lambda e: list(e.path))
            if not errors:
                return
            problems = []
            for e in errors[:10]:
                where = "arguments" + "".join(f"[{p!r}]" for p in e.path)
                message = e.message if len(e.message) <= 300 else f"{e.message[:200]}…{e.message[-80:]}"
                problems.append(f"{where[:200]}: {message}")
        except RecursionError:
            raise _Unusable("bad_arguments", f"the arguments are nested too deeply. Expected "
                                             f"{signature(self.tools[name])}.", name) from None
        raise _Unusable("bad_arguments", f"invalid arguments — {'; '.join(problems)}. Expected "
                                         f"{signature(self.tools[name])}.", name, args)  # kept: a placeholder in them
        # still counts (shipyard.harness.validity), so breaking the schema cannot hide one

    def _near_misses(self, content: str) -> list[ToolCall]:
        """Calls written outside <tool_call> tags (see the module docstring): reported, or run when accepted."""
        found: list[tuple[int, str, bool]] = []  # (position, text, whether it runs to the end of the turn unclosed)
        decoder, pos, tries = json.JSONDecoder(), content.find("{"), 0
        while pos != -1 and len(found) < 16 and tries < MAX_NEAR_MISS_TRIES:
            tries += 1
            try:
                obj, end = decoder.raw_decode(content, pos)
            except (ValueError, RecursionError):  # not JSON, or JSON Python will not decode (5000-digit numbers)
                head = CALL_HEAD.match(content, pos)
                if head is not None and self._attempted(content, pos, None, head.group(3), bool(head.group(4))):
                    stop = _attempt_end(content, pos)
                    found.append((pos, content[pos:stop].rstrip(), stop == len(content)))
                    pos = content.find("{", stop)
                else:
                    pos = content.find("{", pos + 1)
                continue
            if isinstance(obj, dict) and self._attempted(content, pos, end, obj.get("name"),
                                                         isinstance(obj.get("arguments"), dict | str)):
                found.append((pos, content[pos:end], False))
                pos = content.find("{", end)
            elif '"name"' in content[pos + 1:end]:  # a call may be nested in another object (OpenAI's "function")
                pos = content.find("{", pos + 1)
            else:
                pos = content.find("{", end)
        found += [(m.start(), m.group(0), not m.group(3)) for m in FUNCTION_RE.finditer(content)]
        found.sort(key=lambda f: f[0])
        if self.untagged == "accept":
            calls = [self._parse_body(i, raw, raw, at_end) for i, (_, raw, at_end) in enumerate(found)]
            for call in calls:
                call.untagged = True
            return calls
        calls = []
        for i, (_, raw, at_end) in enumerate(found):
            message = f"it was not executed: it is not wrapped in {OPEN}…{CLOSE} tags (code fences do not count)."
            name, args = None, None
            try:
                name, args = self._read(raw, at_end)
            except _Unusable as e:
                message += f" It also has this problem: {e.message}"
                name, args = e.name, e.arguments
            call = _failed(i, raw, "untagged", message)
            call.name, call.arguments = name, args  # what it would have run: validity still sees a placeholder
            calls.append(call)
        return calls

    def _attempted(self, content: str, start: int, end: int | None, name: Any, has_arguments: bool) -> bool:
        """Whether the object at `content[start:end]` (`end` None: it does not decode) is an attempted call: it names
        one of our tools (anywhere), or it is `{"name": NAME, "arguments": …}` standing on its own lines (alone on
        them, or alone in a code fence), so that a snippet inside prose or code is never taken for a call."""
        if isinstance(name, str) and name in self.tools:
            return True
        if not (has_arguments and isinstance(name, str) and TOOL_NAME.fullmatch(name)):
            return False
        before = content[content.rfind("\n", 0, start) + 1:start]
        after = "" if end is None else content[end:].split("\n", 1)[0]
        return FENCE_OPENER.fullmatch(before) is not None and after.strip() in ("", FENCE)

    def _add_help(self, calls: list[ToolCall]) -> None:
        """Append the expected format, one example and the tool list to the turn's first format error (once: a turn
        of many broken calls does not repeat it)."""
        first = next((c for c in calls if c.error_kind in FORMAT_KINDS), None)
        if first is None or first.error is None:
            return
        example = ('{"name": "list_dir", "arguments": {"path": "."}}' if "list_dir" in self.tools else
                   json.dumps({"name": next(iter(self.tools), "tool"), "arguments": {}}))
        first.error += (f"\nWrite each call as one JSON object with \"name\" and \"arguments\" inside {OPEN}{CLOSE} "
                        f"tags, with no code fence, for example:\n{OPEN}\n{example}\n{CLOSE}")
        if "Available tools:" not in first.error:  # an unknown tool's message lists them already
            first.error += f"\nAvailable tools: {', '.join(self.tools)}."


def _failed(index: int, raw: str, kind: ErrorKind, what: str) -> ToolCall:
    return ToolCall(index, None, None, raw, f"tool call #{index + 1}: {what}", error_kind=kind)


def _cut_opener(text: str) -> str:
    """The start of a `<tool_call>` tag that the turn ended inside (`<tool_c`), or ''."""
    text = text.rstrip()
    return next((OPEN[:k] for k in range(len(OPEN) - 1, MIN_CUT_OPENER - 1, -1) if text.endswith(OPEN[:k])), "")


def _attempt_end(content: str, start: int) -> int:
    """Where an undecodable attempted call ends: at its code fence's closing, else at a blank line, else the end."""
    ends = [i for i in (content.find(FENCE, start), content.find("\n\n", start)) if i != -1]
    return min(ends, default=len(content))


def _unclosed(text: str) -> bool:
    """Whether `text` ends inside a string or with a bracket still open (JSON, or a Python literal's quotes)."""
    depth, quote, escaped = 0, "", False
    for ch in text:
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return bool(quote) or depth > 0


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
