"""The wire format: how a conversation becomes the token ids the model sees, one turn at a time.

The first prompt (system turn with the tool specs, then the task) is rendered through the model's own chat
template, so the model sees the format it was trained on; tokenizers without a template get ChatML with a
Hermes `<tools>` block (`render_chatml`). If a template silently drops the tools (many templates have no
tools branch), the tool block is put into the system turn by the harness instead — the model must always
see its tools.

After that, history is **never re-rendered**. The sampled completion ids are kept as they were generated,
and only the *continuation* — the end of the assistant turn, the `<tool_response>` turn and the next
assistant header — is rendered and tokenized. It is found by rendering a fixed dummy conversation with and
without the tool messages through the same template and taking the difference, so it follows whatever the
template does (Qwen groups consecutive tool results into one user turn, each in `<tool_response>` tags).

**How the call tags become ids** (`Tags`). Where a tokenizer has `<tool_call>`/`</tool_call>` as added tokens,
`"token"` encodes the tags in the prompt, the hints and the observations as those tokens, as the chat template
does. `"spelled"` writes them in ordinary pieces (`<`, `tool`, `_call`, `>`) instead — for a model whose output row
of the tag token was never trained (the bundled Qwen2.5-Coder-0.5B's equals the rows of 11 never-used added tokens;
p(`<tool_call>`) ~1e-10 in every context, `shipyard bench hint_probe`): it can write the tag's text only in pieces,
and it copies pieces it was shown (first turns holding the tag: 0/24 with the token in the prompt, 10/24 spelled;
docs/benchmarks.md). Either way the parser reads decoded text, where both are the same tag, and the sampled ids are
kept as they were; the setting only decides what the model is shown, so training, evaluation and serving must use
the same one (`shipyard.rollout.episode.wire_defaults`).

**Text is never a control token** (`shipyard.harness.controls`). The task statement, tool outputs, hints and a chat
client's messages come from repositories, models and clients, and may spell the template's control tokens. Where a
content does, the messages are rendered with a placeholder for each content instead (`_SLOT`), the contents are put
back, and a control token is kept only where the template wrote it; a spelling inside a content is encoded as
ordinary pieces. Contents that spell none are rendered and encoded as they always were — the same text, the same ids,
whatever the template does with them. The call tags inside content follow `tags` as everywhere: they are the format.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from shipyard.harness.controls import ControlTokens, Span
from shipyard.harness.parse import CLOSE, OPEN
from shipyard.harness.tools.base import Tool

Tags = Literal["token", "spelled"]
TAGS: tuple[Tags, ...] = ("token", "spelled")
_TAG = re.compile(f"({re.escape(OPEN)}|{re.escape(CLOSE)})")

SENTINEL = "\x00SHIPYARD-ASSISTANT-END\x00"
# Where message i's content goes in a rendering (ASCII letters and digits: templates may escape anything else); the
# nonce keeps text that a client or a repository writes from forging one.
_NONCE = secrets.token_hex(8)
_SLOT = "SHIPYARDSLOT" + _NONCE + "N{}E"
_SLOTS = re.compile("SHIPYARDSLOT" + _NONCE + r"N(\d+)E")

SYSTEM_PROMPT = """\
You are a coding agent working in a software repository (the workspace). Solve the user's task by calling \
tools: explore the code, make focused edits, and run the tests to check your work.

Call a tool by writing a JSON object inside <tool_call></tool_call> tags. For example, to list the files \
at the root of the workspace, write exactly:
<tool_call>
{"name": "list_dir", "arguments": {"path": "."}}
</tool_call>
Never put tool calls in code fences. You may make several calls in one turn; they run in parallel and \
their results come back in the same order. Paths are relative to the workspace root.
When the task is done, reply with a short summary and no tool call; that ends the session."""

HERMES_TOOLS = """

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tag_token_twins(model: Any, tokenizer: PreTrainedTokenizerBase) -> list[str] | None:
    """The tokenizer's other added tokens whose output row in `model` equals that of `<tool_call>` (cosine > 0.999:
    equal up to a quantized checkpoint's noise, ~4e-4 in the bundled GGUF); None when the tag is no single token.
    Two or more — rows shared with tokens no training text holds (`<|box_start|>`, `<|vision_pad|>`, …) — mean
    the row is its initialisation, never trained: the model cannot write the token, and needs `tags = "spelled"`."""
    import torch

    ids = tokenizer.encode(OPEN, add_special_tokens=False)
    if len(ids) != 1:
        return None
    tag, rows = ids[0], model.get_output_embeddings().weight.detach()
    added = sorted(i for i in tokenizer.get_added_vocab().values() if i < rows.shape[0] and i != tag)
    if not added:
        return []
    cosine = torch.nn.functional.cosine_similarity(rows[added].float(), rows[tag][None].float(), dim=-1)
    return [tokenizer.convert_ids_to_tokens(i) for i, c in zip(added, cosine.tolist(), strict=True) if c > 0.999]


def hermes_block(tools: list[dict[str, Any]]) -> str:
    return HERMES_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def render_chatml(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  add_generation_prompt: bool) -> str:
    """ChatML with Hermes tools, for tokenizers without a chat template (mirrors Qwen2.5's template)."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{m['content']}\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1]["role"] != "tool":
                out.append("<|im_end|>\n")
            continue
        content = m["content"]
        if i == 0 and m["role"] == "system" and tools:
            content += hermes_block(tools)
        out.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


@dataclass
class Continuation:
    """Pieces of text that follow a sampled assistant turn (see `ChatFormat.continuation_ids`)."""

    closing: str  # what the template writes after the assistant's content, e.g. "<|im_end|>\n"
    between: str  # from there up to and including the next assistant header


class ChatFormat:
    """Renders the first prompt and every later continuation for one tokenizer and tool set."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: list[Tool], system_prompt: str = SYSTEM_PROMPT,
                 tags: Tags = "token"):
        if tags not in TAGS:
            raise ValueError(f"tags must be one of {TAGS}, not {tags!r}")
        self.tokenizer = tokenizer
        self.tags = tags
        self.tools = [t.schema() for t in tools]
        self.tool_names = [t.name for t in tools]
        self.system_prompt = system_prompt
        self.uses_template = bool(getattr(tokenizer, "chat_template", None))
        self.controls = ControlTokens(tokenizer)
        if (spelled := self.controls.spelled(json.dumps(self.tools, ensure_ascii=False))) is not None:
            raise ValueError(f"a tool's name, description or parameters spell the model's control token {spelled!r}; "
                             "tool specs are shown to the model as the template's own text: remove it")
        self.template_renders_tools = self.uses_template and self._template_shows_tools()
        self.stop_token_ids = self._stop_token_ids()

    def _template_shows_tools(self) -> bool:
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        text = self.tokenizer.apply_chat_template(probe, tools=self.tools, tokenize=False, add_generation_prompt=True)
        return all(f'"{name}"' in text for name in self.tool_names)

    def _stop_token_ids(self) -> tuple[int, ...]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            ids.add(im_end)
        return tuple(sorted(ids))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """Render whole messages to text (first prompt, dummy conversations, debugging)."""
        if not self.uses_template:
            return render_chatml(messages, self.tools, add_generation_prompt)
        if self.template_renders_tools:
            return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        if messages and messages[0]["role"] == "system":
            messages = [{**messages[0], "content": messages[0]["content"] + hermes_block(self.tools)}, *messages[1:]]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str, literal: Sequence[Span] = ()) -> list[int]:
        """`text` as ids, control tokens matched but inside the `literal` spans (contents, in order: module docstring,
        `shipyard.harness.controls`); with `tags = "spelled"` the call tags in ordinary pieces (module docstring): a
        tag without its last character matches no added token, so it splits into BPE pieces."""
        out: list[int] = []
        for piece, kind in self.controls.segments(text, literal):
            if kind == "spelling":
                out += self.controls.literal_ids(piece)
            elif kind == "template":
                out += self._encode(piece)
            else:
                ids = self._encode(piece)  # a control token here is one the normalizer made (controls.py)
                out += ids if self.controls.ids.isdisjoint(ids) else self.controls.plain_ids(piece)
        return out

    def completion_ids(self, text: str) -> list[int]:
        """The ids of `text` as a policy writes it under this wire: the call tags as their control tokens (`token`) or
        in ordinary pieces (`spelled`). A replayed or scripted completion that is to train the policy (SFT's gold
        demonstrations) must be these ids: under `spelled` the tag token is one the model cannot write."""
        return self._encode(text)

    def tag_ids(self) -> set[int]:
        """The ids of the call tags when each is one token of the tokenizer (none otherwise)."""
        ids = [self.tokenizer.encode(tag, add_special_tokens=False) for tag in (OPEN, CLOSE)]
        return {i[0] for i in ids if len(i) == 1}

    def _encode(self, text: str) -> list[int]:
        if self.tags == "token":
            return self.tokenizer.encode(text, add_special_tokens=False)
        out: list[int] = []
        for piece in _TAG.split(text):
            if piece in (OPEN, CLOSE):
                out += self.tokenizer.encode(piece[:-1], add_special_tokens=False)
                out += self.tokenizer.encode(piece[-1], add_special_tokens=False)
            elif piece:
                out += self.tokenizer.encode(piece, add_special_tokens=False)
        return out

    def _contents_ids(self, render: Callable[[Sequence[str]], str], contents: Sequence[str]) -> list[int]:
        """The ids of `render(contents)`, its contents as text: rendered and encoded as they are when none spells a
        control token, else rendered with placeholders, filled back in and encoded with their spans (module
        docstring)."""
        if all(self.controls.spelled(c) is None for c in contents):
            return self.encode(render(contents))
        return self.encode(*_filled(render([_SLOT.format(i) for i in range(len(contents))]), contents))

    def render_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """Messages rendered and encoded, their contents as text: a control token spelled in a content is not one."""
        def render(contents: Sequence[str]) -> str:
            given = iter(contents)
            return self.render([{**m, "content": next(given)} if isinstance(m.get("content"), str) else m
                                for m in messages], add_generation_prompt)

        return self._contents_ids(render, [m["content"] for m in messages if isinstance(m.get("content"), str)])

    def prompt_ids(self, task: str) -> list[int]:
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": task}]
        return self.render_ids(messages, add_generation_prompt=True)

    def assistant_header_ids(self) -> tuple[int, ...]:
        """The ids that open an assistant turn (the generation prompt ending every prompt and continuation)."""
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        without, with_header = self.render(base, False), self.render(base, True)
        if not with_header.startswith(without):
            raise RuntimeError("the chat template renders the conversation differently with a generation prompt")
        return tuple(self.encode(with_header[len(without):]))

    def hint_ids(self, hint: str) -> tuple[int, ...]:
        """A hint (targeted textual feedback) rendered as a user message, to go right before an assistant turn's
        header in the teacher's context (see `shipyard.train.batch`)."""
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        before = self.render(base, False)

        def render(contents: Sequence[str]) -> str:
            after = self.render([*base, {"role": "user", "content": contents[0]}], False)
            if not after.startswith(before):
                raise RuntimeError("the chat template renders earlier turns differently once a message follows")
            return after[len(before):]

        return tuple(self._contents_ids(render, [hint]))

    def continuation(self, tool_results: list[str]) -> Continuation:
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": SENTINEL}]
        prefix = self.render(base, add_generation_prompt=False)
        full = self.render(base + [{"role": "tool", "content": r} for r in tool_results], add_generation_prompt=True)
        if not full.startswith(prefix) or SENTINEL not in prefix:
            raise RuntimeError("the chat template renders earlier turns differently once tool results follow; "
                               "shipyard cannot append turns incrementally with it (use a ChatML-style template)")
        return Continuation(closing=prefix[prefix.rindex(SENTINEL) + len(SENTINEL):], between=full[len(prefix):])

    def continuation_ids(self, completion_ids: list[int], tool_results: list[str]) -> list[int]:
        """Ids to append after a sampled completion so that the next turn can be generated; the tool results are
        text (module docstring).

        If the completion ended with a stop token whose text starts the template's closing (`<|im_end|>`), only
        the rest of the closing is added; if it was cut off (max tokens), the whole closing is added.
        """
        def render(contents: Sequence[str]) -> str:
            cont = self.continuation(list(contents))
            closing = cont.closing
            if completion_ids and completion_ids[-1] in self.stop_token_ids:
                stop_text = self.tokenizer.decode([completion_ids[-1]])
                if closing.startswith(stop_text):
                    closing = closing[len(stop_text):]
            return closing + cont.between

        return self._contents_ids(render, tool_results)


def _filled(rendered: str, contents: Sequence[str]) -> tuple[str, list[Span]]:
    """The rendering with each content put back where its placeholder is; the contents' spans. ValueError for a
    template that drops or repeats a content (its own text could not be told from the content's)."""
    parts, spans, last, at, seen = [], [], 0, 0, []
    for m in _SLOTS.finditer(rendered):
        content = contents[int(m.group(1))]
        parts += [rendered[last:m.start()], content]
        at += m.start() - last
        spans.append((at, at + len(content)))
        at += len(content)
        last = m.end()
        seen.append(int(m.group(1)))
    if sorted(seen) != list(range(len(contents))):
        raise ValueError("the chat template drops or repeats a message's content that spells a control token; "
                         "shipyard cannot tell that content from the template's own tokens with it")
    return "".join(parts) + rendered[last:], spans
