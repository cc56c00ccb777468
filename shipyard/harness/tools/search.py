"""`codebase_search`: find code by what it does, not by the words it happens to use.

The harness only says what the tool needs — a `Searcher` that answers a query over the workspace as it is now — and
how the answer is shown to the model; `shipyard.search` implements it (syntax-aware chunks, embeddings, BM25, an
index refreshed with the episode's own edits). An episode without a searcher does not offer the tool at all
(`tools_for`), so a model is never shown a tool that cannot work.

Results are ranked `path:start-end` locations, each with its enclosing symbol and its first lines numbered as
`read_file` numbers them, so the model can go straight to `read_file` with an offset or to `search_replace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shipyard.harness.tools.base import Tool, ToolContext, ToolError, params, plain_text, truncate_middle
from shipyard.harness.workspace import Workspace

MAX_RESULTS = 10
SNIPPET_LINES = 8
MAX_QUERY_CHARS = 1000
MAX_DIRECTORIES = 20


@dataclass(frozen=True)
class SearchResult:
    path: str
    start: int  # 1-based, inclusive
    end: int
    symbol: str | None
    text: str  # the chunk's lines


class Searcher(Protocol):
    def wrote(self, paths: set[str] | None) -> None:
        """A tool call is about to write these workspace files (None: any file, e.g. a terminal command)."""
        ...

    def search(self, workspace: Workspace, query: str, directories: list[str] | None, k: int) -> list[SearchResult]:
        """The `k` chunks of the workspace's files (as they are now) that best answer `query`, best first; only under
        `directories` (workspace-relative, already checked) when given. Infrastructure failures raise `InfraError`."""
        ...


def codebase_search(ctx: ToolContext, query: str, directories: list[str] | None = None) -> str:
    if ctx.searcher is None:
        raise ToolError("codebase_search is not available in this session; use grep or glob.")
    plain_text(query, "query")
    if not query.strip():
        raise ToolError("query is empty: describe the code you are looking for, e.g. 'where the config is parsed'.")
    if len(query) > MAX_QUERY_CHARS:
        raise ToolError(f"query is {len(query)} characters long; keep it under {MAX_QUERY_CHARS}.")
    dirs = None
    if directories:
        if len(directories) > MAX_DIRECTORIES:
            raise ToolError(f"give at most {MAX_DIRECTORIES} directories.")
        dirs = []
        for directory in directories:
            rel = ctx.workspace.resolve(plain_text(directory, "directory"))
            if ctx.workspace.kind(rel) != "dir":
                raise ToolError(f"'{directory}' is not a directory in the workspace.")
            dirs.append(rel)
        dirs = None if "." in dirs else dirs
    results = ctx.searcher.search(ctx.workspace, query, dirs, MAX_RESULTS)
    if not results:
        where = f" under {', '.join(directories)}" if directories else ""
        return f"No code found for {query!r}{where}."
    blocks = []
    for r in results:
        head = f"{r.path}:{r.start}-{r.end}" + (f"  ({r.symbol})" if r.symbol else "")
        lines = r.text.split("\n")
        shown = "\n".join(f"{r.start + i}\t{line[:300]}" for i, line in enumerate(lines[:SNIPPET_LINES]))
        more = f"\n\t… {len(lines) - SNIPPET_LINES} more lines" if len(lines) > SNIPPET_LINES else ""
        blocks.append(f"{head}\n{shown}{more}")
    return truncate_middle("\n\n".join(blocks), ctx.max_output_bytes)


TOOLS = [
    Tool("codebase_search", "Find code by meaning: the functions, classes and passages that best match a description "
         "in plain language (semantic and keyword search over the workspace as it is now). Returns ranked "
         "path:start-end locations with their first lines; use it before grep when you do not know the names.",
         params(["query"],
                query={"type": "string", "description": "What the code does, e.g. 'convert integers to roman "
                       "numerals' or 'where HTTP retries are configured'."},
                directories={"type": "array", "items": {"type": "string"},
                             "description": "Only search under these directories (relative). Default: everywhere."}),
         codebase_search),
]
