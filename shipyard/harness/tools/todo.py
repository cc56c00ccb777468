"""`todo_write`: the model's own task list, kept for the episode and echoed back in full.

Planning tools measurably help agents stay on track over long episodes (Claude Code and Cursor ship one);
the harness only stores and renders the list. Each call replaces the whole list, which keeps the tool
stateless from the model's point of view: what it wrote is exactly what it has.
"""

from __future__ import annotations

from shipyard.harness.tools.base import Tool, ToolContext, ToolError, params

STATUSES = ("pending", "in_progress", "completed")
MARKS = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]"}


def todo_write(ctx: ToolContext, todos: list[dict[str, str]]) -> str:
    ids = [t["id"] for t in todos]
    if len(set(ids)) != len(ids):
        raise ToolError("todo ids must be unique.")
    if sum(t["status"] == "in_progress" for t in todos) > 1:
        raise ToolError("at most one todo may be in_progress at a time.")
    ctx.todos = [dict(t) for t in todos]
    if not todos:
        return "todo list cleared."
    done = sum(t["status"] == "completed" for t in todos)
    lines = [f"{MARKS[t['status']]} {t['id']}: {t['content']}" for t in todos]
    return f"todo list ({done}/{len(todos)} done):\n" + "\n".join(lines)


TOOLS = [
    Tool("todo_write", "Replace your todo list for this task. Use it to plan multi-step work and track progress.",
         params(["todos"], todos={
             "type": "array",
             "items": {"type": "object", "additionalProperties": False, "required": ["id", "content", "status"],
                       "properties": {"id": {"type": "string"}, "content": {"type": "string"},
                                      "status": {"type": "string", "enum": list(STATUSES)}}}}),
         todo_write),
]
