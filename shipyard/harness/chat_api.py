"""`POST /v1/chat/completions` with OpenAI-style `tools` and `tool_calls`, so any OpenAI-compatible agent client can
run a shipyard-trained model unchanged.

Why it lives in the harness: a model trained by shipyard learned one wire format — the harness's (`wire.ChatFormat`:
the model's own chat template with the tool specs, calls as JSON in `<tool_call>` tags) — and is only as good in
production as the fidelity with which production repeats it. So this endpoint renders a chat request exactly as an
episode renders its prompt (`ChatFormat`, with the client's tools in place of ours), stops where an episode's turn
stops (the template's end-of-turn ids), and reads the reply with the episode's parser (`ToolCallParser`, with the
same wire settings as training: `shipyard.rollout.episode.wire_defaults` for the served model — the untagged-call
setting, and whether the call tags are spelled in ordinary tokens).

**History.** An assistant message's `tool_calls` are written back the way the model writes them — its text, then
each call as `<tool_call>{"name": …, "arguments": …}</tool_call>` — and `tool` messages become the template's tool
responses, so a multi-turn conversation looks to the model like an episode. A `tool` message must answer a call id
of an earlier assistant message. A call that repeats one of an earlier assistant message (same name, same arguments)
has its result noted as an episode's is (`shipyard.harness.trajectory.FirstCalls`): the served model reads what it
was trained on.

**Replies.** Calls the parser accepts become `message.tool_calls` (`function.arguments` a JSON string, ids
`call_…`), `finish_reason` `tool_calls`; what the model wrote outside them is `content`, and an attempted call that
does not parse (unknown tool, bad JSON, arguments against the schema) stays in `content` as text rather than being
dropped or guessed. `tool_choice`: `auto` (default) and `none` (no tools shown, nothing parsed); `required` and a
named function would need constrained decoding, which shipyard's engines do not do: refused with 400, never faked.

**Streaming.** `stream: true` answers with server-sent `chat.completion.chunk` events (role, content, one event
per tool call, the finish reason, `data: [DONE]`), the shape OpenAI clients parse. Chunks are sent when the
generation is complete: the engines return whole completions, and a call can only be told from text once it is
closed, so a client sees the reply at once rather than token by token.

**Hostile input.** Everything is validated by pydantic models and then against the template: unknown roles, parts
that are not text, tool schemas that are not JSON Schema, duplicate tool names, orphan tool messages, too many
tools or messages, prompts that cannot fit the context (checked on characters before tokenizing, then on tokens) —
400 with what to change; limits, the API key, batching, overload and disconnects are the completions endpoint's
(`shipyard.models.server`), shared through `app.state.generate`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import StreamingResponse
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from shipyard.harness.parse import CLOSE, OPEN, ParsedTurn, ToolCallParser
from shipyard.harness.tools.base import Tool
from shipyard.harness.trajectory import FirstCalls, call_key, noted
from shipyard.harness.wire import SYSTEM_PROMPT, ChatFormat, Tags
from shipyard.models.engine import Engine, SamplingParams
from shipyard.models.server import SamplingRequest, chars_per_token

MAX_TOOLS = 128
MAX_MESSAGES = 2048
DEFAULT_MAX_TOKENS = 1024
ToolName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][\w.\-]{0,63}$")]


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: ToolName
    description: str = Field("", max_length=16384)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: ToolName
    arguments: str | dict[str, Any] = "{}"


class CallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[CallIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)


def _unrunnable(**_: Any) -> str:
    raise RuntimeError("a client's tool runs on the client, never on the server")


def client_tools(specs: list[ToolSpec]) -> list[Tool]:
    """The request's tools as harness `Tool`s (for rendering and parsing only), each schema checked."""
    tools, seen = [], set()
    for spec in specs:
        f = spec.function
        if f.name in seen:
            raise HTTPException(400, f"tools: the name '{f.name}' is given twice")
        seen.add(f.name)
        try:
            Draft202012Validator.check_schema(f.parameters)
        except SchemaError as e:
            raise HTTPException(400, f"tools: '{f.name}'.parameters is not a JSON Schema: {e.message[:300]}") from None
        except RecursionError:
            raise HTTPException(400, f"tools: '{f.name}'.parameters is nested too deeply") from None
        if f.parameters.get("type", "object") != "object":
            raise HTTPException(400, f"tools: '{f.name}'.parameters must describe an object (type: object)")
        _unicode(json.dumps([f.name, f.description, f.parameters], ensure_ascii=False), f"tools: '{f.name}'")
        tools.append(Tool(f.name, f.description, f.parameters, _unrunnable))
    return tools


def _text(message: Message, where: str) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return _unicode(message.content, where)
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise HTTPException(400, f"{where}: only text content parts are supported (type 'text' with a 'text' "
                                     f"string), not {str(part.get('type'))[:40]!r}")
        parts.append(part["text"])
    return _unicode("".join(parts), where)


def _unicode(text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate (JSON allows "\ud800"): no tokenizer takes it
        raise HTTPException(400, f"{where}: the content is not valid Unicode ({e.reason} at character {e.start}); "
                                 "send UTF-8 text") from None
    return text


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The conversation as the harness renders it (module docstring: calls written back in the wire format, a repeated
    call's result noted)."""
    out: list[dict[str, Any]] = []
    calls: dict[str, int | None] = {}  # call id → the earlier turn the call repeats, or None
    first_calls, turn = FirstCalls(), 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        text = _text(m, where)
        if m.role == "assistant":
            turn += 1
            for call in m.tool_calls or ():
                try:
                    args = json.loads(call.function.arguments) if isinstance(call.function.arguments, str) \
                        else call.function.arguments
                except (ValueError, RecursionError):
                    raise HTTPException(400, f"{where}.tool_calls: the arguments of '{call.id}' are not JSON") from None
                calls[call.id] = first_calls.repeats(call_key(call.function.name, args), turn)
                body = json.dumps({"name": call.function.name, "arguments": args}, ensure_ascii=False)
                text += ("\n" if text else "") + f"{OPEN}\n{body}\n{CLOSE}"
            out.append({"role": "assistant", "content": _unicode(text, where)})  # arguments may hold "\ud800"
        elif m.role == "tool":
            if m.tool_call_id is None or m.tool_call_id not in calls:
                raise HTTPException(400, f"{where}: a tool message must answer the id of a call in an earlier "
                                         f"assistant message (tool_call_id {m.tool_call_id!r} is not one)")
            first = calls[m.tool_call_id]
            out.append({"role": "tool", "content": text if first is None else noted(text, first)})
        else:
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def _reply(parsed: ParsedTurn, text: str, finish: str) -> tuple[dict[str, Any], str]:
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
             for c in parsed.valid_calls]
    failed = [c.raw for c in parsed.calls if c.error is not None]
    content = "\n".join(p for p in (parsed.content, *failed) if p) if parsed.calls else text
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    return message, "tool_calls" if calls else ("length" if finish == "length" else "stop")


def _chunks(doc: dict[str, Any]) -> Iterator[str]:
    """The reply as OpenAI `chat.completion.chunk` server-sent events."""
    head = {"id": doc["id"], "object": "chat.completion.chunk", "created": doc["created"], "model": doc["model"]}

    def event(index: int, delta: dict[str, Any], finish: str | None = None) -> str:
        chunk = {**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    for choice in doc["choices"]:
        i, message = choice["index"], choice["message"]
        yield event(i, {"role": "assistant", "content": ""})
        if message["content"]:
            yield event(i, {"content": message["content"]})
        for k, call in enumerate(message.get("tool_calls", [])):
            yield event(i, {"tool_calls": [{"index": k, **call}]})
        yield event(i, {}, choice["finish_reason"])
    yield f"data: {json.dumps({**head, 'choices': [], 'usage': doc['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def add_chat_completions(app: FastAPI, engine: Engine, served_name: str,
                         untagged: Literal["reject", "accept"] = "reject", tags: Tags = "token") -> None:
    """Add `POST /v1/chat/completions` to the app `shipyard.models.server.create_app(engine, …)` made (its limits,
    batching, API key)."""
    tokenizer, config, context = engine.tokenizer, app.state.serve_config, app.state.context
    per_token = chars_per_token(tokenizer)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        if body.model not in (None, served_name):
            raise HTTPException(404, f"model '{body.model}' is not served here; this server serves '{served_name}'")
        choice = body.tool_choice or "auto"
        if choice not in ("auto", "none"):
            raise HTTPException(400, f"tool_choice {json.dumps(choice)[:80]} is not supported: shipyard does not "
                                     "constrain decoding; use 'auto' (the model decides) or 'none'")
        if body.n > config.max_sequences:
            raise HTTPException(400, f"n={body.n} is over this server's limit of {config.max_sequences} sequences")
        max_tokens = body.max_completion_tokens or body.max_tokens or min(DEFAULT_MAX_TOKENS, config.max_tokens)
        if max_tokens > config.max_tokens:
            raise HTTPException(400, f"max_tokens={max_tokens} is over this server's limit of {config.max_tokens}")
        tools = client_tools(body.tools or []) if choice == "auto" else []
        messages = template_messages(body.messages)
        if tools and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})  # the tools' place in templates that need one
        chars = sum(len(m["content"]) for m in messages) + sum(len(json.dumps(t.schema())) for t in tools)
        if chars > (context - max_tokens) * per_token:
            raise HTTPException(400, f"the conversation ({chars} characters) cannot fit the model's context of "
                                     f"{context} tokens with max_tokens={max_tokens}; shorten it")
        try:  # a tool spec spelling a control token, a template that drops a content that spells one
            fmt = await asyncio.to_thread(ChatFormat, tokenizer, tools, SYSTEM_PROMPT, tags)
            prompt = await asyncio.to_thread(fmt.render_ids, messages, True)  # contents as text (wire.py)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        if len(prompt) + max_tokens > context:
            raise HTTPException(400, f"a prompt of {len(prompt)} tokens plus max_tokens={max_tokens} is over the "
                                     f"model's context of {context} tokens; shorten the conversation or ask for at "
                                     f"most {max(context - len(prompt), 0)} tokens")
        stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        results = await app.state.generate(request, [prompt], body.n, lambda seed: SamplingParams(
            max_tokens, body.temperature, body.top_p, stops, fmt.stop_token_ids, seed), body.seed)
        if results is None:
            return Response(status_code=499)  # the client has gone
        parser = ToolCallParser(tools, untagged) if tools else None
        choices = []
        for i, c in enumerate(results):
            parsed = parser.parse(c.text) if parser is not None else ParsedTurn(c.text, [])
            message, finish = _reply(parsed, c.text, c.finish_reason)
            choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": None})
        completion_tokens = sum(len(c.token_ids) for c in results)
        doc = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
               "model": served_name, "choices": choices, "policy_version": min(c.policy_version for c in results),
               "usage": {"prompt_tokens": len(prompt) * body.n, "completion_tokens": completion_tokens,
                         "total_tokens": len(prompt) * body.n + completion_tokens}}
        if body.stream:
            return StreamingResponse(_chunks(doc), media_type="text/event-stream")
        return doc
