"""Read-only file tools: `read_file`, `list_dir`, `glob`, `grep`.

Their output is shaped for a model with a limited context: line numbers so that edits can be targeted,
explicit continuation hints ("call read_file with offset=…"), and hard caps on listing sizes with the
number of entries left out. `grep` is ripgrep (fast, respects .gitignore), run as a process in the workspace
so that it behaves the same in a local directory and inside a sandbox.
"""

from __future__ import annotations

from pathlib import Path

from shipyard.harness.tools.base import Tool, ToolContext, ToolError, params, truncate_middle

MAX_LINE_CHARS = 2000
DEFAULT_READ_LINES = 2000
MAX_LIST_ENTRIES = 500
MAX_GLOB_RESULTS = 200
MAX_GREP_LINES = 200


def _missing(ctx: ToolContext, path: str) -> ToolError:
    return ToolError(f"'{path}' does not exist. Use list_dir or glob to find the right path.")


def is_binary(data: bytes) -> bool:
    return b"\x00" in data[:8192]


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
    data = ws.read_bytes(rel)
    if is_binary(data):
        return f"'{path}' is a binary file ({len(data)} bytes); its contents are not shown."
    lines = data.decode(errors="replace").splitlines()
    if not lines:
        return f"'{path}' is empty."
    if offset > len(lines):
        raise ToolError(f"offset {offset} is past the end of '{path}', which has {len(lines)} lines.")
    end = min(len(lines), offset - 1 + limit)
    body = []
    for number in range(offset, end + 1):
        line = lines[number - 1]
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + f" [... line truncated, {len(line) - MAX_LINE_CHARS} more chars]"
        body.append(f"{number:>6}\t{line}")
    text = "\n".join(body)
    if offset > 1 or end < len(lines):
        text += f"\n[lines {offset}-{end} of {len(lines)}"
        text += f"; call read_file with offset={end + 1} to continue]" if end < len(lines) else "]"
    return truncate_middle(text, ctx.max_output_bytes)


def list_dir(ctx: ToolContext, path: str = ".") -> str:
    ws = ctx.workspace
    rel = ws.resolve(path)
    kind = ws.kind(rel)
    if kind == "missing":
        raise _missing(ctx, path)
    if kind != "dir":
        raise ToolError(f"'{path}' is a file, not a directory; use read_file to read it.")
    entries = [e for e in ws.listdir(rel) if e.name != ".git"]
    lines = []
    for entry in entries[:MAX_LIST_ENTRIES]:
        if entry.kind == "link":
            lines.append(f"{entry.name} -> {entry.target}")
        elif entry.kind == "dir":
            lines.append(f"{entry.name}/")
        else:
            lines.append(f"{entry.name}  ({entry.size} bytes)")
    if len(entries) > MAX_LIST_ENTRIES:
        lines.append(f"[... {len(entries) - MAX_LIST_ENTRIES} more entries not shown]")
    return f"{rel}/ ({len(entries)} entries)\n" + ("\n".join(lines) if lines else "(empty directory)")


def glob(ctx: ToolContext, pattern: str, path: str = ".") -> str:
    if pattern.startswith("/") or ".." in Path(pattern).parts:
        raise ToolError("pattern must be relative to `path` and may not contain '..', e.g. '**/*.py'.")
    base = ctx.workspace.resolve(path)
    if ctx.workspace.kind(base) != "dir":
        raise ToolError(f"'{path}' is not a directory.")
    matches = ctx.workspace.glob(pattern, base)
    if not matches:
        return f"no paths match '{pattern}' under '{path}'."
    shown = "\n".join(matches[:MAX_GLOB_RESULTS])
    if len(matches) > MAX_GLOB_RESULTS:
        shown += f"\n[... {len(matches) - MAX_GLOB_RESULTS} more matches; narrow the pattern]"
    return shown


def grep(ctx: ToolContext, pattern: str, path: str = ".", glob: str | None = None, ignore_case: bool = False,
         context: int = 0) -> str:
    rel = ctx.workspace.resolve(path)
    if ctx.workspace.kind(rel) == "missing":
        raise _missing(ctx, path)
    if not 0 <= context <= 20:
        raise ToolError("context must be between 0 and 20 lines.")
    argv = ["rg", "--line-number", "--no-heading", "--with-filename", "--color", "never", "--max-columns", "400",
            "--max-columns-preview", "--sort", "path", "--hidden", "--glob", "!.git"]
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
    if result.exit_code == 1:
        return f"no matches for /{pattern}/ under '{path}'" + (f" (files matching '{glob}')." if glob else ".")
    if result.exit_code != 0:
        raise ToolError(f"grep failed: {out.strip()}")
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
