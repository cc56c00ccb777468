"""Rich rendering of an agent episode for the terminal: one panel per turn, the final diff, a summary line.

Reads are summarised (path and line count), edits are shown as coloured diffs, terminal output is shown
with its command (last lines only), and every error is shown in red exactly as the model received it.
"""

from __future__ import annotations

import difflib
import json
import re

from rich.console import Console, Group
from rich.panel import Panel
from rich.syntax import Syntax
from rich.text import Text

from shipyard.harness.parse import ParsedTurn
from shipyard.harness.trajectory import CallRecord, Trajectory, Turn

MAX_TERMINAL_LINES = 20
NUMBERED = re.compile(r"\s*\d+\t")


def _edit_diff(rec: CallRecord) -> Syntax | None:
    args = rec.arguments or {}
    if rec.name == "search_replace":
        old, new = args.get("old_string", ""), args.get("new_string", "")
    elif rec.name == "write_file":
        old, new = "", args.get("content", "")
    else:
        return None
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=2))[2:]
    return Syntax("\n".join(lines[:60]), "diff", theme="ansi_dark", background_color="default")


def render_call(rec: CallRecord) -> Group:
    args = rec.arguments or {}
    head = Text("▸ ", style="bold cyan")
    head.append(rec.name or "(malformed call)", style="bold")
    detail = args.get("path") or args.get("pattern") or args.get("command") or ""
    if not detail and args:
        detail = json.dumps(args)[:100]
    head.append(f" {str(detail)[:200]}", style="cyan")
    head.append(f"  {rec.seconds * 1000:.0f} ms", style="dim")
    parts: list = [head]
    if rec.error is not None:
        parts.append(Text(rec.error[:800], style="red"))
    elif rec.name == "read_file":
        shown = sum(1 for line in rec.output.splitlines() if NUMBERED.match(line))
        parts.append(Text(f"  read {shown} lines", style="dim"))
    elif rec.name in ("search_replace", "write_file"):
        parts.append(Text(f"  {rec.output}", style="green"))
        diff = _edit_diff(rec)
        if diff is not None:
            parts.append(diff)
    elif rec.name == "run_terminal":
        lines = rec.output.splitlines()
        shown = lines[-MAX_TERMINAL_LINES:]
        if len(lines) > len(shown):
            shown = [f"[... {len(lines) - len(shown)} earlier lines]", *shown]
        parts.append(Text("\n".join(shown), style="white"))
    else:
        first = rec.output.splitlines()[:6]
        parts.append(Text("\n".join(first) + (" …" if rec.output.count("\n") > 5 else ""), style="dim"))
    return Group(*parts)


def render_turn(turn: Turn, parsed: ParsedTurn) -> Panel:
    body: list = []
    if parsed.content:
        text = parsed.content if len(parsed.content) < 1200 else parsed.content[:1200] + " …"
        body.append(Text(text, style="italic"))
    body += [render_call(rec) for rec in turn.calls]
    title = (f"turn {turn.index + 1} · {len(turn.completion_ids)} tokens in {turn.generate_seconds:.1f} s · "
             f"{len(turn.calls)} call(s)" + (f", {turn.parallel_width} in parallel" if turn.parallel_width > 1 else ""))
    return Panel(Group(*body) if body else Text("(empty turn)", style="dim"), title=title, title_align="left",
                 border_style="blue")


def render_end(console: Console, traj: Trajectory) -> None:
    if traj.patch:
        console.print(Panel(Syntax(traj.patch, "diff", theme="ansi_dark", background_color="default"),
                            title="changes", title_align="left", border_style="green"))
    else:
        console.print(Text("no files changed", style="dim"))
    s = traj.summary()
    console.print(f"[bold]{s['stop_reason']}[/]: {s['turns']} turns, {s['tool_calls']} tool calls "
                  f"({s['failed_calls']} failed), mean parallel width {s['mean_parallel_width']:.2f}, "
                  f"{s['sampled_tokens']} sampled / {s['total_tokens']} total tokens, {s['seconds']:.1f} s")
