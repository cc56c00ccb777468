"""The agent's tools, in the order the model sees them.

`codebase_search` (semantic search; `shipyard.search` is its backend) sits between `grep` and the editing tools. It is
offered only in an episode that has a searcher (`tools_for`): a model is never shown a tool that cannot work.
"""

from shipyard.harness.tools import edit, files, lint, search, terminal, todo
from shipyard.harness.tools.base import Tool, ToolContext, ToolError, truncate_middle
from shipyard.harness.tools.search import Searcher, SearchResult

__all__ = ["SearchResult", "Searcher", "Tool", "ToolContext", "ToolError", "default_tools", "tools_for",
           "truncate_middle"]


def default_tools() -> list[Tool]:
    """read_file, list_dir, glob, grep, codebase_search, search_replace, write_file, delete_file, read_lints,
    run_terminal, todo_write: every tool the harness has."""
    return [*files.TOOLS, *search.TOOLS, *edit.TOOLS, *lint.TOOLS, *terminal.TOOLS, *todo.TOOLS]


def tools_for(searcher: Searcher | None) -> list[Tool]:
    """The tools of an episode: all of them, but `codebase_search` only with a searcher to answer it."""
    return [t for t in default_tools() if searcher is not None or t.name != "codebase_search"]
