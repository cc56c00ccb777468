"""Tools that change files: `search_replace`, `write_file`, `delete_file`, and the syntax gate they share.

`search_replace` is the main editing tool (as in Cursor and Claude Code): an exact, unique string match is
replaced, which is robust to line-number drift and easy for a model to produce. A match that is missing or
ambiguous is an error that says how to fix the call (the closest line, or the lines of every match).

The **syntax gate** rejects an edit that would turn a file that parses into one that does not (Python via
`compile`, JSON, TOML). A broken edit is the most common way small models derail an episode; refusing it
with the parser's message keeps the file intact and tells the model exactly what to fix. Files that were
already broken can still be edited (the model may be repairing them); the result then carries a warning.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path

from shipyard.harness.tools.base import Tool, ToolContext, ToolError, params


def syntax_error(path: str, text: str) -> str | None:
    """The parser's complaint about `text` as the contents of `path`, or None if it parses (or is not checked)."""
    suffix = Path(path).suffix
    try:
        if suffix in (".py", ".pyi"):
            compile(text, path, "exec", dont_inherit=True)
        elif suffix == ".json":
            json.loads(text)
        elif suffix == ".toml":
            tomllib.loads(text)
    except SyntaxError as e:
        where = f"line {e.lineno}" + (f", column {e.offset}" if e.offset else "")
        line = f": {e.text.rstrip()!r}" if e.text else ""
        return f"{type(e).__name__}: {e.msg} ({where}{line})"
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _gate(path: str, before: str | None, after: str) -> str:
    """Raise if the edit breaks a file that parsed; return a warning if the file stays broken."""
    new_error = syntax_error(path, after)
    if new_error is None:
        return ""
    if before is None or syntax_error(path, before) is None:
        raise ToolError(f"edit rejected: it would leave '{path}' with a syntax error — {new_error}. "
                        "The file was not changed; fix the new text and try again.")
    return f"\nwarning: '{path}' still does not parse — {new_error}"


def _read_text(ctx: ToolContext, rel: str, path: str) -> str:
    kind = ctx.workspace.kind(rel)
    if kind == "dir":
        raise ToolError(f"'{path}' is a directory.")
    if kind == "missing":
        raise ToolError(f"'{path}' does not exist. Use write_file to create a new file.")
    try:
        return ctx.workspace.read_bytes(rel).decode()
    except UnicodeDecodeError as e:
        raise ToolError(f"'{path}' is not UTF-8 text and cannot be edited with search_replace.") from e


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _not_found(path: str, text: str, old: str) -> ToolError:
    first = next((line for line in old.splitlines() if line.strip()), old).strip()
    lines = text.splitlines()
    stripped = [line.strip() for line in lines]
    close = difflib.get_close_matches(first, stripped, n=1, cutoff=0.6)
    hint = ""
    if close:
        number = stripped.index(close[0])
        hint = f" The closest line is {number + 1}: {lines[number]!r}."
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
        starts, i = [], text.find(old_string)
        while i != -1:
            starts.append(_line_of(text, i))
            i = text.find(old_string, i + 1)
        raise ToolError(f"old_string occurs {count} times in '{path}' (lines {', '.join(map(str, starts))}). "
                        "Include more surrounding lines to make it unique, or set replace_all to true.")
    first_line = _line_of(text, text.find(old_string))
    updated = text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1)
    warning = _gate(path, text, updated)
    ctx.workspace.write_bytes(rel, updated.encode())
    span = new_string.count("\n") + 1
    what = f"{count} occurrences" if count > 1 else f"lines {first_line}-{first_line + span - 1}"
    return f"edited '{path}': replaced {what}.{warning}"


def write_file(ctx: ToolContext, path: str, content: str) -> str:
    ws = ctx.workspace
    rel = ws.resolve(path)
    kind = ws.kind(rel)
    if kind == "dir":
        raise ToolError(f"'{path}' is a directory.")
    before = ws.read_bytes(rel).decode(errors="replace") if kind == "file" else None
    warning = _gate(path, before, content)
    ws.write_bytes(rel, content.encode())
    verb = "overwrote" if before is not None else "created"
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
