"""Read-only file tools: `read_file`, `list_dir`, `glob`, `grep`.

Their output is shaped for a model with a limited context: line numbers so that edits can be targeted,
explicit continuation hints ("call read_file with offset=…"), and hard caps on listing sizes with the
number of entries left out. `grep` is ripgrep (fast, respects .gitignore), run as a process in the workspace
so that it behaves the same in a local directory and inside a sandbox.
"""

from __future__ import annotations

import re

from shipyard.harness.tools.base import (
    Tool,
    ToolContext,
    ToolError,
    display_path,
    installed_binary,
    params,
    plain_text,
    truncate_middle,
)
from shipyard.harness.workspace import MAX_DIR_ENTRIES

MAX_LINE_CHARS = 2000
DEFAULT_READ_LINES = 2000
MAX_LIST_ENTRIES = 500
MAX_GLOB_RESULTS = 200
MAX_GREP_LINES = 200
# rg's exit code 2 says some file could not be read; output starting like a match still holds the results.
_MATCH_LINE = re.compile(r"[^\n]*?[:-]\d+[:-]")


def _missing(ctx: ToolContext, path: str) -> ToolError:
    return ToolError(f"'{path}' does not exist. Use list_dir or glob to find the right path.")


def is_binary(data: bytes) -> bool:
    return b"\x00" in data[:8192]


def _skip_lines(text: str, pos: int, n: int) -> int:
    """The index after the `n`-th newline from `pos` (or the end): C-speed counting, a short loop at the end."""
    while n > 0 and pos < len(text):
        stop = min(len(text), pos + (1 << 16))
        k = text.count("\n", pos, stop)
        if k < n:
            n, pos = n - k, stop
            continue
        for _ in range(n):
            pos = text.index("\n", pos) + 1
        n = 0
    return pos


def read_file(ctx: ToolContext, path: str, offset: int = 1, limit: int = DEFAULT_READ_LINES) -> str:
    ws = ctx.workspace
    rel = ws.resolve(path)
    kind = ws.kind(rel)
    if kind == "dir":
        raise ToolError(f"'{path}' is a directory; use list_dir to see its contents.")
    if kind == "missing":
        raise _missing(ctx, path)
    if offset < 1:
        raise ToolError("offset is a 1-based line number and must be >= 1.")
    if limit < 1:
        raise ToolError("limit must be >= 1.")
    data = ws.read_bytes(rel)  # refuses special files and files over MAX_FILE_BYTES
    if is_binary(data):
        return f"'{path}' is a binary file ({len(data)} bytes); its contents are not shown."
    text = data.decode(errors="replace")
    del data
    if not text:
        return f"'{path}' is empty."
    # Lines end at "\n" only (as grep and ruff count them); only the lines shown are ever split out.
    total = text.count("\n") + (not text.endswith("\n"))
    if offset > total:
        raise ToolError(f"offset {offset} is past the end of '{path}', which has {total} lines.")
    pos, budget, body = _skip_lines(text, 0, offset - 1), ctx.max_output_bytes - 200, []
    number = offset
    while number < offset + limit and number <= total:
        nxt = text.find("\n", pos) + 1 or len(text)
        line = text[pos:nxt].removesuffix("\n").removesuffix("\r")
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + f" [... line truncated, {len(line) - MAX_LINE_CHARS} more chars]"
        entry = f"{number:>6}\t{line}"
        budget -= len(entry.encode(errors="surrogatepass")) + 1
        if budget < 0 and body:
            break  # the rest would not fit in one response; the footer says where to continue
        body.append(entry)
        pos, number = nxt, number + 1
    end = number - 1
    text = "\n".join(body)
    if offset > 1 or end < total:
        text += f"\n[lines {offset}-{end} of {total}"
        text += f"; call read_file with offset={end + 1} to continue]" if end < total else "]"
    return truncate_middle(text, ctx.max_output_bytes)


def list_dir(ctx: ToolContext, path: str = ".") -> str:
    ws = ctx.workspace
    rel = ws.resolve(path)
    kind = ws.kind(rel)
    if kind == "missing":
        raise _missing(ctx, path)
    if kind != "dir":
        raise ToolError(f"'{path}' is a file, not a directory; use read_file to read it.")
    listed = ws.listdir(rel)
    entries = [e for e in listed if e.name != ".git"]
    lines = []
    for entry in entries[:MAX_LIST_ENTRIES]:
        name = display_path(entry.name)
        if entry.kind == "link":
            lines.append(f"{name} -> {display_path(entry.target or '')}")
        elif entry.kind == "dir":
            lines.append(f"{name}/")
        else:
            lines.append(f"{name}  ({entry.size} bytes)")
    count = f"more than {MAX_DIR_ENTRIES}" if len(listed) > MAX_DIR_ENTRIES else str(len(entries))
    if len(entries) > MAX_LIST_ENTRIES:
        lines.append(f"[... {count} entries in all, only the first {MAX_LIST_ENTRIES} shown; use glob or "
                     "run_terminal (`ls | head`) to look further]")
    out = f"{display_path(rel)}/ ({count} entries)\n" + ("\n".join(lines) if lines else "(empty directory)")
    return truncate_middle(out, ctx.max_output_bytes)


def glob(ctx: ToolContext, pattern: str, path: str = ".") -> str:
    plain_text(pattern, "pattern")
    if not pattern.strip():
        raise ToolError("the pattern is empty; e.g. '**/*.py' or 'tests/test_*.py'.")
    if pattern.startswith("/") or ".." in pattern.split("/"):
        raise ToolError("pattern must be relative to `path` and may not contain '..', e.g. '**/*.py'.")
    base = ctx.workspace.resolve(path)
    if ctx.workspace.kind(base) != "dir":
        raise ToolError(f"'{path}' is not a directory.")
    matches = ctx.workspace.glob(pattern, base)
    if not matches:
        return f"no paths match '{pattern}' under '{path}'."
    shown = "\n".join(display_path(m) for m in matches[:MAX_GLOB_RESULTS])
    if len(matches) > MAX_GLOB_RESULTS:
        shown += f"\n[... {len(matches) - MAX_GLOB_RESULTS} more matches; narrow the pattern]"
    return truncate_middle(shown, ctx.max_output_bytes)


def grep(ctx: ToolContext, pattern: str, path: str = ".", glob: str | None = None, ignore_case: bool = False,
         context: int = 0) -> str:
    plain_text(pattern, "pattern")
    if glob is not None:
        plain_text(glob, "glob")
    rel = ctx.workspace.resolve(path)
    kind = ctx.workspace.kind(rel)
    if kind == "missing":
        raise _missing(ctx, path)
    if kind == "other":
        raise ToolError(f"'{path}' is not a regular file or directory (a FIFO, socket or device); grep searches "
                        "files and directories only.")
    if not 0 <= context <= 20:
        raise ToolError("context must be between 0 and 20 lines.")
    # --no-config: no RIPGREP_CONFIG_PATH; --no-messages: an unreadable file is skipped, not a failed search.
    argv = [installed_binary("rg"), "--no-config", "--no-messages", "--line-number", "--no-heading", "--with-filename",
            "--color", "never", "--max-columns", "400", "--max-columns-preview", "--sort", "path", "--hidden",
            "--glob", "!.git"]
    if ignore_case:
        argv.append("--ignore-case")
    if context:
        argv += ["--context", str(context)]
    if glob:
        argv += ["--glob", glob]
    argv += ["--regexp", pattern, "--", rel] if rel != "." else ["--regexp", pattern]
    result = ctx.workspace.run(argv, timeout=30)
    out = result.output.decode(errors="replace")
    if result.timed_out:
        raise ToolError("grep took longer than 30 s; narrow `path` or `glob`.")
    if result.exit_code == 1 or (result.exit_code == 2 and not out.strip()):
        unread = " (some files could not be read)" if result.exit_code == 2 else ""
        return (f"no matches for /{pattern}/ under '{path}'" + (f" (files matching '{glob}')" if glob else "")
                + f"{unread}.")
    if result.exit_code != 0 and not (result.exit_code == 2 and _MATCH_LINE.match(out)):
        raise ToolError(f"grep failed: {truncate_middle(out.strip(), 2000)}")
    lines = out.splitlines()
    if len(lines) > MAX_GREP_LINES:
        lines = [*lines[:MAX_GREP_LINES], f"[... {len(lines) - MAX_GREP_LINES} more lines; narrow the search]"]
    return truncate_middle("\n".join(lines), ctx.max_output_bytes)


TOOLS = [
    Tool("read_file", "Read a text file. Lines are numbered (`number<TAB>line`); use offset/limit for long files.",
         params(["path"],
                path={"type": "string", "description": "File path relative to the workspace root."},
                offset={"type": "integer", "description": "First line to show (1-based). Default 1."},
                limit={"type": "integer", "description": f"Number of lines to show. Default {DEFAULT_READ_LINES}."}),
         read_file, path_arg="path"),
    Tool("list_dir", "List a directory: sub-directories first (ending in /), then files with their sizes.",
         params([], path={"type": "string", "description": "Directory relative to the workspace root. Default '.'."}),
         list_dir),
    Tool("glob", "Find files by glob pattern, e.g. '**/*.py' or 'tests/test_*.py'. Returns sorted paths.",
         params(["pattern"],
                pattern={"type": "string", "description": "Glob pattern relative to `path`; '**' matches any depth."},
                path={"type": "string", "description": "Directory to search from. Default '.'."}),
         glob),
    Tool("grep", "Search file contents with a regular expression (ripgrep syntax). Prints path:line:text.",
         params(["pattern"],
                pattern={"type": "string", "description": "Regular expression to search for."},
                path={"type": "string", "description": "File or directory to search. Default '.'."},
                glob={"type": "string", "description": "Only search files matching this glob, e.g. '*.py'."},
                ignore_case={"type": "boolean", "description": "Case-insensitive search. Default false."},
                context={"type": "integer", "description": "Lines of context around each match (0-20)."}),
         grep),
]
