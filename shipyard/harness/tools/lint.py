"""`read_lints`: ruff's diagnostics for the workspace (or some paths of it), one line per finding.

Ruff runs as a process in the workspace, so the project's own ruff configuration (pyproject.toml, ruff.toml)
applies, and the same call works inside a sandbox. Only Python files are linted; that is where the task
repositories and the example library live.
"""

from __future__ import annotations

import json

from ruff.__main__ import find_ruff_bin

from shipyard.harness.tools.base import Tool, ToolContext, ToolError, params, truncate_middle

MAX_FINDINGS = 100


def read_lints(ctx: ToolContext, paths: list[str] | None = None) -> str:
    targets = [ctx.workspace.resolve(p) for p in (paths or ["."])]
    argv = [str(find_ruff_bin()), "check", "--output-format", "json", "--no-cache", "--exit-zero", "--", *targets]
    result = ctx.workspace.run(argv, timeout=60)
    if result.timed_out:
        raise ToolError("ruff took longer than 60 s; lint fewer paths.")
    try:
        findings = json.loads(result.output.decode(errors="replace") or "[]")
    except json.JSONDecodeError as e:
        raise ToolError(f"ruff failed: {truncate_middle(result.output, 2000)}") from e
    if not findings:
        return f"no lint errors in {', '.join(targets)}."
    root = ctx.workspace.exec_root.rstrip("/") + "/"
    lines = []
    for f in findings[:MAX_FINDINGS]:
        path = f["filename"].removeprefix(root)
        loc = f["location"]
        lines.append(f"{path}:{loc['row']}:{loc['column']}: {f['code'] or 'E'} {f['message']}")
    if len(findings) > MAX_FINDINGS:
        lines.append(f"[... {len(findings) - MAX_FINDINGS} more findings]")
    return truncate_middle(f"{len(findings)} lint finding(s):\n" + "\n".join(lines), ctx.max_output_bytes)


TOOLS = [
    Tool("read_lints", "Lint Python files with ruff and list the findings (path:line:col: CODE message).",
         params([], paths={"type": "array", "items": {"type": "string"},
                           "description": "Files or directories to lint. Default: the whole workspace."}),
         read_lints),
]
