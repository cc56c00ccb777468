"""Text helpers: slugs, case conversion, wrapping, edit distance."""

from __future__ import annotations

import re
import unicodedata


def slugify(text: str, separator: str = "-") -> str:
    """ASCII, lower-case, separator-joined words: 'Héllo, World!' -> 'hello-world'."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    words = re.findall(r"[a-z0-9]+", ascii_text.lower())
    return separator.join(words)


def snake_case(name: str) -> str:
    """'parseHTTPResponse' -> 'parse_http_response'."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return re.sub(r"[-\s]+", "_", name).lower()


def camel_case(name: str) -> str:
    """'parse_http_response' -> 'parseHttpResponse'."""
    parts = [p for p in re.split(r"[_\-\s]+", name) if p]
    if not parts:
        return ""
    return parts[0].lower() + "".join(p.capitalize() for p in parts[1:])


def wrap(text: str, width: int) -> list[str]:
    """Greedy word wrap; words longer than ``width`` are put on a line of their own."""
    if width < 1:
        raise ValueError("width must be positive")
    lines: list[str] = []
    current = ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions) between two strings."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def truncate(text: str, limit: int, ellipsis: str = "…") -> str:
    """Shorten ``text`` to at most ``limit`` characters, ending with ``ellipsis`` if cut."""
    if len(text) <= limit:
        return text
    if limit <= len(ellipsis):
        return ellipsis[:limit]
    return text[: limit - len(ellipsis)] + ellipsis
