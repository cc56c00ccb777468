"""Tools that change files: `search_replace`, `write_file`, `delete_file`, and the syntax gate they share.

`search_replace` is the main editing tool (as in Cursor and Claude Code): an exact, unique string match is
replaced, which is robust to line-number drift and easy for a model to produce. A match that is missing or
ambiguous is an error that says how to fix the call (the closest line, or the lines of every match).

The **syntax gate** rejects an edit that would turn a file that parses into one that does not (Python via
`compile`, JSON, TOML). A broken edit is the most common way small models derail an episode; refusing it
with the parser's message keeps the file intact and tells the model exactly what to fix. Files that were
already broken can still be edited (the model may be repairing them); the result then carries a warning.

The gate runs in the harness's own process (on the host, whatever the workspace), so it is bounded: files over
`MAX_GATE_CHARS` are not parsed (CPython's compiler needs up to ~350 bytes of memory per byte of a pathological
source such as `x = 1,1,1,…`), one parse runs at a time (parallel edits of one turn would multiply that), and a
parser that gives up on a source (too deeply nested: `RecursionError`, `MemoryError`) rejects it like a syntax
error. All other work on a file's text is bounded too: at most `MAX_FILE_BYTES` in and out, line
numbers of only the first few matches, a closest-line search with a time budget.
"""

from __future__ import annotations

import difflib
import json
import threading
import time
import tomllib
from pathlib import Path

from shipyard.harness.tools.base import EditRejected, Tool, ToolContext, ToolError, params
from shipyard.harness.workspace import MAX_FILE_BYTES, PathError

MAX_GATE_CHARS = 256 << 10
_PARSING = threading.Lock()
SHOWN_MATCHES = 20
CLOSEST_LINE_SECONDS = 1.0


def syntax_error(path: str, text: str) -> str | None:
    """The parser's complaint about `text` as the contents of `path`, or None if it parses (or is not checked)."""
    suffix = Path(path).suffix
    try:
        with _PARSING:
            if suffix in (".py", ".pyi"):
                compile(text, path, "exec", dont_inherit=True)
            elif suffix == ".json":
                json.loads(text)
            elif suffix == ".toml":
                tomllib.loads(text)
    except SyntaxError as e:
        where = f"line {e.lineno}" + (f", column {e.offset}" if e.offset else "")
        line = f": {e.text.rstrip()[:200]!r}" if e.text else ""
        return f"{type(e).__name__}: {str(e.msg)[:500]} ({where}{line})"
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        return f"{type(e).__name__}: {str(e)[:500]}"
    except (RecursionError, MemoryError):
        return "the parser gave up: the code is nested too deeply (or is too long a chain of operators)"
    except ValueError as e:  # e.g. "source code string cannot contain null bytes"
        return f"{type(e).__name__}: {str(e)[:500]}"
    return None


def syntax_gate(path: str, before: str | None, after: str) -> str:
    """Raise `EditRejected` if the edit breaks a file that parsed; return a warning if the file stays broken. (Gold
    demonstrations check their edits with it too, `shipyard.rollout.gold.edits`.)"""
    if len(after) > MAX_GATE_CHARS or (before is not None and len(before) > MAX_GATE_CHARS):
        checked = Path(path).suffix in (".py", ".pyi", ".json", ".toml")
        return f"\nnote: '{path}' is over {MAX_GATE_CHARS} characters and was not syntax-checked." if checked else ""
    new_error = syntax_error(path, after)
    if new_error is None:
        return ""
    if before is None or syntax_error(path, before) is None:
        raise EditRejected(f"edit rejected: it would leave '{path}' with a syntax error — {new_error}. "
                        "The file was not changed; fix the new text and try again.")
    return f"\nwarning: '{path}' still does not parse — {new_error}"


def _read_text(ctx: ToolContext, rel: str, path: str) -> str:
    kind = ctx.workspace.kind(rel)
    if kind == "dir":
        raise ToolError(f"'{path}' is a directory.")
    if kind == "missing":
        raise ToolError(f"'{path}' does not exist. Use write_file to create a new file.")
    try:
        return ctx.workspace.read_bytes(rel).decode()  # refuses special files and files over MAX_FILE_BYTES
    except UnicodeDecodeError as e:
        raise ToolError(f"'{path}' is not UTF-8 text and cannot be edited with search_replace.") from e


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _closest_line(text: str, wanted: str) -> tuple[int, str] | None:
    """The (number, line) most like `wanted` (ratio >= 0.6, as difflib.get_close_matches), within a time budget."""
    wanted = wanted[:400]
    matcher = difflib.SequenceMatcher()
    matcher.set_seq2(wanted)
    best, best_ratio = None, 0.6
    deadline = time.monotonic() + CLOSEST_LINE_SECONDS
    start, number = 0, 0
    while start <= len(text):
        end = text.find("\n", start)
        end = len(text) if end == -1 else end
        line, start, number = text[start:end], end + 1, number + 1
        if number % 256 == 0 and time.monotonic() > deadline:
            break
        matcher.set_seq1(line.strip()[:400])
        if (matcher.real_quick_ratio() >= best_ratio and matcher.quick_ratio() >= best_ratio
                and (ratio := matcher.ratio()) >= best_ratio and (best is None or ratio > best_ratio)):
            best, best_ratio = (number, line.removesuffix("\r")), ratio
    return best


def _not_found(path: str, text: str, old: str) -> ToolError:
    first = next((line for line in old.splitlines() if line.strip()), old).strip()
    close = _closest_line(text, first)
    hint = ""
    if close:
        number, line = close
        hint = f" The closest line is {number}: {line[:300]!r}."
    return ToolError(f"old_string was not found in '{path}'. It must match the file exactly, including "
                     f"indentation and whitespace; read the file again before retrying.{hint}")


def search_replace(ctx: ToolContext, path: str, old_string: str, new_string: str, replace_all: bool = False) -> str:
    rel = ctx.workspace.resolve(path)
    if old_string == "":
        raise ToolError("old_string is empty; to create or overwrite a whole file use write_file.")
    if old_string == new_string:
        raise ToolError("old_string and new_string are identical; nothing would change.")
    text = _read_text(ctx, rel, path)
    if old_string not in text and "\r\n" in text:  # a CRLF file edited with LF strings
        old_string, new_string = old_string.replace("\n", "\r\n"), new_string.replace("\n", "\r\n")
    count = text.count(old_string)
    if count == 0:
        raise _not_found(path, text, old_string)
    if count > 1 and not replace_all:
        starts, i, line, last = [], text.find(old_string), 1, 0
        while i != -1 and len(starts) < SHOWN_MATCHES:
            line, last = line + text.count("\n", last, i), i
            starts.append(str(line))
            i = text.find(old_string, i + 1)
        more = f", and {count - len(starts)} more" if count > len(starts) else ""
        raise ToolError(f"old_string occurs {count} times in '{path}' (lines {', '.join(starts)}{more}). "
                        "Include more surrounding lines to make it unique, or set replace_all to true.")
    replaced = count if replace_all else 1
    if len(text) + replaced * (len(new_string) - len(old_string)) > MAX_FILE_BYTES:
        raise ToolError(f"the edit would make '{path}' larger than {MAX_FILE_BYTES} bytes, the most a tool writes; "
                        "nothing was changed.")
    first_line = _line_of(text, text.find(old_string))
    updated = text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1)
    warning = syntax_gate(path, text, updated)
    ctx.workspace.write_bytes(rel, _encode(path, updated))
    span = new_string.count("\n") + 1
    what = f"{count} occurrences" if count > 1 else f"lines {first_line}-{first_line + span - 1}"
    return f"edited '{path}': replaced {what}.{warning}"


def _encode(path: str, text: str) -> bytes:
    try:
        data = text.encode()
    except UnicodeEncodeError as e:
        raise ToolError(f"the new text for '{path}' contains {text[e.start]!r}, a lone surrogate that is not valid "
                        "UTF-8; nothing was written.") from None
    if len(data) > MAX_FILE_BYTES:
        raise ToolError(f"the new text for '{path}' is {len(data)} bytes, more than the {MAX_FILE_BYTES} a tool "
                        "writes; nothing was written.")
    return data


def write_file(ctx: ToolContext, path: str, content: str) -> str:
    ws = ctx.workspace
    rel = ws.resolve(path)
    kind = ws.kind(rel)
    if kind == "dir":
        raise ToolError(f"'{path}' is a directory.")
    data = _encode(path, content)
    before = None
    if kind == "file":
        try:
            before = ws.read_bytes(rel).decode(errors="replace")
        except PathError:
            before = None  # too big to read (it is replaced whole) or no longer a regular file (the write says so)
    warning = syntax_gate(path, before, content)
    ws.write_bytes(rel, data)
    verb = "overwrote" if kind != "missing" else "created"
    return f"{verb} '{path}' ({content.count(chr(10)) + (0 if content.endswith(chr(10)) else 1)} lines).{warning}"


def delete_file(ctx: ToolContext, path: str) -> str:
    ws = ctx.workspace
    rel = ws.resolve(path)
    if rel == ".":
        raise ToolError("refusing to delete the workspace root.")
    kind = ws.kind(rel)
    if kind == "dir":
        raise ToolError(f"'{path}' is a directory; delete_file removes single files only.")
    if kind == "missing":
        raise ToolError(f"'{path}' does not exist.")
    ws.delete(rel)
    return f"deleted '{path}'."


TOOLS = [
    Tool("search_replace",
         "Edit a file by replacing an exact string. old_string must match the file exactly (whitespace included) "
         "and be unique unless replace_all is true. Edits that would introduce a syntax error are rejected.",
         params(["path", "old_string", "new_string"],
                path={"type": "string", "description": "File to edit, relative to the workspace root."},
                old_string={"type": "string", "description": "Exact text to replace (include enough context)."},
                new_string={"type": "string", "description": "Replacement text."},
                replace_all={"type": "boolean", "description": "Replace every occurrence. Default false."}),
         search_replace, path_arg="path", mutates=True),
    Tool("write_file", "Create a file, or overwrite it entirely, with the given content (parent dirs are created).",
         params(["path", "content"],
                path={"type": "string", "description": "File to write, relative to the workspace root."},
                content={"type": "string", "description": "The complete new file contents."}),
         write_file, path_arg="path", mutates=True),
    Tool("delete_file", "Delete a file.",
         params(["path"], path={"type": "string", "description": "File to delete, relative to the workspace root."}),
         delete_file, path_arg="path", mutates=True),
]
