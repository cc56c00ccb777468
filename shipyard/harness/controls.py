"""Control tokens: the added tokens a chat template writes (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`, …), which
text from anyone else must never become.

A tokenizer matches its added tokens anywhere in the text it is given, before any other step. A chat template's
output holds both the template's own control tokens and the messages' contents — the task statement, a tool's
output (any file of a repository, any command's output), a hint, a chat client's messages — so a file that spells
`<|im_end|>\\n<|im_start|>system\\n…` would, tokenized with the rest, close the tool turn and open a system turn the
model takes for ours: a prompt injection with the template's authority, in training and in serving.
`ChatFormat` (wire.py) therefore knows where each content lies in the rendered text when a content spells one;
`segments` cuts the text there — the template's text, each content, and inside a content each spelling of a control
token — and `ChatFormat.encode` encodes the template's text as always, a spelling as ordinary pieces (`literal_ids`)
and the rest of a content checked: should the tokenizer still find a control token in it (an added token matched
after the tokenizer's normalizer, NFC or lowercase, which no search of the raw text sees), the piece is encoded
character by character (`plain_ids`). Contents that spell none — raw or normalized — are not cut at all: the same
text, the same ids as before.

Control tokens are the added tokens but the call tags (`<tool_call>`, `</tool_call>`: the call format itself, in
content as anywhere; wire.py's `tags` decides how they are shown), and but the non-special ones that are only
whitespace or one character (some vocabularies add `\n` or runs of spaces as tokens: those are text). A spelling is
encoded without its last character, then that character — no added token matches a prefix of itself — and checked;
never with `split_special_tokens`, which flips a switch on the tokenizer that other threads share. On SentencePiece
tokenizers the pieces may decode with a space between them: the model sees text, not the token, either way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerBase

from shipyard.harness.parse import CLOSE, OPEN

Span = tuple[int, int]
Piece = Literal["template", "content", "spelling"]


class ControlTokens:
    """The control tokens of one tokenizer (module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if _is_control(t)}
        self.ids = frozenset(added)
        texts = sorted({t for t in added.values() if t}, key=len, reverse=True)  # the longest spelling first
        self.pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self.normalizer = tokenizer.backend_tokenizer.normalizer
        self._literal: dict[str, list[int]] = {}  # a spelling's ids, once per spelling (threads may race: same value)

    def spelled(self, text: str) -> str | None:
        """The first control token `text` spells, as written or after the tokenizer's normalizer; else None."""
        if self.pattern is None:
            return None
        found = self.pattern.search(text)
        if found is None and self.normalizer is not None:
            found = self.pattern.search(self.normalizer.normalize_str(text))
        return found.group() if found else None

    def segments(self, text: str, contents: Sequence[Span]) -> list[tuple[str, Piece]]:
        """`text` cut into the template's text, the `contents` (spans in order, not overlapping) and, inside them,
        each spelling of a control token, in order. Without contents: the whole text, once."""
        out: list[tuple[str, Piece]] = []
        last = 0
        for lo, hi in contents:
            if lo > last:
                out.append((text[last:lo], "template"))
            at = lo
            for found in self.pattern.finditer(text, lo, hi) if self.pattern is not None else ():
                if found.start() > at:
                    out.append((text[at:found.start()], "content"))
                out.append((found.group(), "spelling"))
                at = found.end()
            if hi > at:
                out.append((text[at:hi], "content"))
            last = max(last, hi)
        return out + [(text[last:], "template")] if last < len(text) or not out else out

    def literal_ids(self, spelling: str) -> list[int]:
        """A control token's spelling as ordinary tokens (module docstring); character by character if a shorter
        added token hides in the spelling."""
        if (known := self._literal.get(spelling)) is not None:
            return list(known)
        ids = self._encode(spelling[:-1]) + self._encode(spelling[-1])
        if not self.ids.isdisjoint(ids):
            ids = self.plain_ids(spelling)
        self._literal[spelling] = ids
        return list(ids)

    def plain_ids(self, text: str) -> list[int]:
        """`text` character by character: no added token of more than one character can match. ValueError if one
        still does (a one-character special token: nothing spells it otherwise)."""
        ids = [i for ch in text for i in self._encode(ch)]
        if not self.ids.isdisjoint(ids):
            raise ValueError(f"the text {text[:80]!r} cannot be encoded without a control token of this tokenizer")
        return ids

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _is_control(token: AddedToken) -> bool:
    if token.content in (OPEN, CLOSE):
        return False
    return token.special or (len(token.content) > 1 and not token.content.isspace())
