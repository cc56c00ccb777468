"""Control tokens: the added tokens a chat template writes (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, …), which
text from anyone else must never become.

A tokenizer matches its added tokens anywhere in the text it is given, before any other step. A chat template's
output holds both the template's own control tokens and the messages' contents — the task statement, a tool's
output (any file of a repository, any command's output), a hint, a chat client's messages — so a file that spells
`<|im_end|>\\n<|im_start|>system\\n…` would, tokenized with the rest, close the tool turn and open a system turn the
model takes for ours: a prompt injection with the template's authority, in training and in serving.
`ChatFormat` (wire.py) therefore knows where each content lies in the rendered text; `segments` cuts the text at
every spelling of a control token that overlaps a content, and `literal_ids` encodes such a spelling as ordinary
pieces. Elsewhere the text is encoded as it always was: an added token splits a tokenizer's input at the same
places, so the pieces around a cut get the ids they would have had.

The call tags (`<tool_call>`, `</tool_call>`) are not control tokens here: they are the call format itself, in
content as anywhere (wire.py's `tags` setting decides how they are shown). `literal_ids` encodes a spelling without
its last character, then that character — no added token matches a prefix of itself — and checks the result; it
never uses `split_special_tokens`, which flips a switch on the tokenizer that other threads share.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from shipyard.harness.parse import CLOSE, OPEN

Span = tuple[int, int]


class ControlTokens:
    """The control tokens of one tokenizer: every added token but the call tags."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.content not in (OPEN, CLOSE)}
        self.ids = frozenset(added)
        texts = sorted({t for t in added.values() if t}, key=len, reverse=True)  # the longest spelling first
        self.pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._literal: dict[str, list[int]] = {}  # a spelling's ids, once per spelling (threads may race: same value)

    def spelled(self, text: str) -> str | None:
        """The first control token `text` spells, or None."""
        found = self.pattern.search(text) if self.pattern is not None else None
        return found.group() if found else None

    def segments(self, text: str, literal: Sequence[Span]) -> list[tuple[str, bool]]:
        """`text` cut around each control-token spelling that overlaps a `literal` span: (piece, is such a spelling),
        in order. Without such spellings: the whole text, once."""
        out: list[tuple[str, bool]] = []
        last = 0
        for found in self.pattern.finditer(text) if literal and self.pattern is not None else ():
            a, b = found.span()
            if any(lo < b and a < hi for lo, hi in literal):
                out += [(text[last:a], False)] if a > last else []
                out.append((found.group(), True))
                last = b
        return out + [(text[last:], False)] if last < len(text) or not out else out

    def literal_ids(self, spelling: str) -> list[int]:
        """A control token's spelling as ordinary tokens (module docstring); character by character if a shorter
        added token hides in the spelling. ValueError if even that yields a control token (a one-character added
        token: nothing spells it otherwise)."""

        if (known := self._literal.get(spelling)) is not None:
            return list(known)

        def encode(s: str) -> list[int]:
            return self.tokenizer.encode(s, add_special_tokens=False)

        ids = encode(spelling[:-1]) + encode(spelling[-1])
        if not self.ids.isdisjoint(ids):
            ids = [i for ch in spelling for i in encode(ch)]
        if not self.ids.isdisjoint(ids):
            raise ValueError(f"the text {spelling!r} cannot be encoded without a control token of this tokenizer")
        self._literal[spelling] = ids
        return list(ids)
