"""The agent's tools, in the order the model sees them.

`codebase_search` (semantic search over an embedding index) has its slot between `grep` and the editing
tools; it joins `default_tools()` once `shipyard/search` provides an index, and until then it is not offered
to the model at all rather than offered as a tool that cannot work.
"""

from shipyard.harness.tools import edit, files, lint, terminal, todo
from shipyard.harness.tools.base import Tool, ToolContext, ToolError, truncate_middle

__all__ = ["Tool", "ToolContext", "ToolError", "default_tools", "truncate_middle"]


def default_tools() -> list[Tool]:
    """read_file, list_dir, glob, grep, [codebase_search], search_replace, write_file, delete_file, read_lints,
    run_terminal, todo_write."""
    return [*files.TOOLS, *edit.TOOLS, *lint.TOOLS, *terminal.TOOLS, *todo.TOOLS]
