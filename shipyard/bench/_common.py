"""Shared output convention for benchmarks: rich tables for people, then one JSON object on the last line."""

from __future__ import annotations

import json
import platform
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()


def status(message: str) -> None:
    """One dim line of what a benchmark is doing; `message` is text, never markup (paths and test ids hold
    brackets)."""
    console.print(f"[dim]· {escape(message)}[/]")


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*[f"{v:.3g}" if isinstance(v, float) else escape(str(v)) for v in r])  # names and paths: text
    console.print(t)


def finish(name: str, figures: dict[str, Any]) -> None:
    """Print the machine-readable last line."""
    print(json.dumps({"bench": name, "machine": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                      **figures}))
