"""`read_lints`: ruff's diagnostics for the workspace (or some paths of it), one line per finding.

Ruff runs as a process in the workspace, so the same call works inside a sandbox. Only Python files are linted;
that is where the task repositories and the example library live. Left to itself ruff would read far more than
the workspace's Python files, so it is fenced in two ways:

* **Configuration.** A `ruff.toml` or `pyproject.toml` may `extend` any file on the machine (ruff's TOML error then
  prints that file's first line), or set `output-file` (a write anywhere) or `cache-dir`; ruff also looks for
  configuration in the workspace's parent directories and the user's home. So ruff always runs `--isolated` (it
  reads no configuration file at all) and the project's own rule settings are passed back as `--config KEY=VALUE`
  overrides: read through the workspace (confined, size-bounded) from the root's `.ruff.toml`, `ruff.toml` or
  `pyproject.toml` (`[tool.ruff]`, else `requires-python` for the target version), keeping only keys that make
  ruff read or write nothing (`ALLOWED`: line length, target version, rule selection, per-file ignores,
  exclusions). Configuration files in subdirectories are not used.
* **Files.** Ruff follows symbolic links (a `leak.py` pointing outside gets linted, and the names in it come back
  in messages; one pointing at /dev/zero eats memory) and opens FIFOs (it hangs). So the files are listed first by
  `find -type f` (regular files only, no link followed, ignored directories pruned), at most `MAX_FILES` of them,
  and handed to ruff through `xargs`.

What is left: a listed file replaced by a link between the listing and ruff's read, a race the model's own
processes could run. It reaches no more than `run_terminal` already does (inside a sandbox the files outside
/workspace are the sandbox's read-only system; without a sandbox the model's shell runs on the host).
"""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

from ruff.__main__ import find_ruff_bin

from shipyard.harness.tools.base import Tool, ToolContext, ToolError, params, truncate_middle
from shipyard.harness.workspace import IGNORED_DIRS, PathError
from shipyard.models.errors import InfraError

MAX_FINDINGS = 100
MAX_FILES = 5000
MAX_PATHS = 100
MAX_OVERRIDE_CHARS = 8000
CONFIGS = (".ruff.toml", "ruff.toml", "pyproject.toml")  # ruff's own order of precedence
ALLOWED = {"line-length", "indent-width", "target-version", "preview", "exclude", "extend-exclude",
           "lint.select", "lint.extend-select", "lint.ignore", "lint.extend-ignore", "lint.per-file-ignores",
           "lint.extend-per-file-ignores", "lint.preview"}
RULE_KEYS = {key.removeprefix("lint.") for key in ALLOWED if key.startswith("lint.")}
# find: regular Python files under the targets (given as ./PATH, so none reads as an option), ignored dirs pruned.
FIND = ('find "$@" \\( -type d \\( ' + " -o ".join(f"-name '{d}'" for d in sorted(IGNORED_DIRS))
        + " \\) -prune \\) -o \\( -type f \\( -name '*.py' -o -name '*.pyi' \\) -print0 \\) 2>/dev/null"
        + f" | head -z -n {MAX_FILES + 1}")


def _toml(value: Any) -> str | None:
    """`value` as an inline TOML value, if it is of a shape the allowed settings take (else None)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | str):
        return json.dumps(value)  # JSON's string escapes are TOML's
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "[" + ", ".join(map(json.dumps, value)) + "]"
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, list) for k, v in value.items()):
        items = [f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()]
        return None if any(i.endswith("= None") for i in items) else "{" + ", ".join(items) + "}"
    return None


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """The allowed settings of one parsed configuration ([tool.ruff] or a ruff.toml), by dotted key."""
    out = {key: config[key] for key in ALLOWED if key in config}
    out |= {f"lint.{key}": config[key] for key in RULE_KEYS if key in config}  # the deprecated top-level form
    lint = config.get("lint")
    if isinstance(lint, dict):
        out |= {f"lint.{key}": lint[key] for key in RULE_KEYS if key in lint}
    return out


def project_overrides(ctx: ToolContext) -> tuple[list[str], str]:
    """`--config` arguments carrying the workspace's allowed ruff settings, and a note for the model if any were
    dropped or the configuration could not be read."""
    ws = ctx.workspace
    for name in CONFIGS:
        if ws.kind(name) == "missing":
            continue
        try:  # through the workspace: a link pointing out, a FIFO or a huge file is refused
            parsed = tomllib.loads(ws.read_bytes(ws.resolve(name)).decode())
        except InfraError:  # the workspace is gone (an OSError too): the episode ends, not a note to the model
            raise
        except (PathError, OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
            return [], f"\n(note: {name} was not used: {str(e)[:300]})"
        config = parsed
        if name == "pyproject.toml":
            tool = parsed.get("tool")
            config = tool.get("ruff") if isinstance(tool, dict) else None
            config = dict(config) if isinstance(config, dict) else {}
            project = parsed.get("project")
            wanted = project.get("requires-python") if isinstance(project, dict) else None
            found = re.match(r"\s*>=?\s*3\.(\d+)", wanted) if isinstance(wanted, str) else None
            if "target-version" not in config and found and 7 <= int(found.group(1)) <= 14:
                config["target-version"] = f"py3{found.group(1)}"  # what ruff infers from requires-python
        args, dropped = [], []
        for key, value in sorted(_settings(config).items()):
            text = _toml(value)
            if text is None or len(text) > MAX_OVERRIDE_CHARS:
                dropped.append(key)
            else:
                args += ["--config", f"{key} = {text}"]
        note = f"\n(note: settings in {name} not used: {', '.join(dropped)})" if dropped else ""
        return args, note
    return [], ""


def read_lints(ctx: ToolContext, paths: list[str] | None = None) -> str:
    if paths is not None and len(paths) > MAX_PATHS:
        raise ToolError(f"at most {MAX_PATHS} paths per call; lint a directory instead.")
    ws = ctx.workspace
    targets = [ws.resolve(p) for p in (paths or ["."])]
    listing = ws.run(["bash", "-c", FIND, "find", *("." if t == "." else f"./{t}" for t in targets)], timeout=30)
    if listing.timed_out:
        raise ToolError("listing the Python files took longer than 30 s; lint fewer paths.")
    files = [f for f in listing.output.split(b"\0") if f]
    if not files:
        return f"no Python files to lint in {', '.join(targets)}."
    more = f"\n(only the first {MAX_FILES} Python files were linted; pass narrower paths)" \
        if len(files) > MAX_FILES else ""
    overrides, note = project_overrides(ctx)
    argv = ["xargs", "-0", "-r", str(find_ruff_bin()), "check", "--isolated", *overrides, "--output-format",
            "json-lines", "--no-cache", "--exit-zero", "--force-exclude", "--"]
    result = ws.run(argv, timeout=60, stdin=b"\0".join(files[:MAX_FILES]) + b"\0")
    if result.timed_out:
        raise ToolError("ruff took longer than 60 s; lint fewer paths.")
    findings: list[dict[str, Any]] = []
    other: list[str] = []
    for line in result.output.decode(errors="replace").splitlines():
        try:
            finding = json.loads(line) if line.startswith("{") else None
        except (json.JSONDecodeError, RecursionError):
            finding = None  # a line cut by the bounded capture
        if isinstance(finding, dict):
            findings.append(finding)
        else:
            other.append(line)
    if result.exit_code != 0 and not findings:
        raise ToolError(f"ruff failed: {truncate_middle(chr(10).join(other), 2000)}{note}")
    if result.dropped_bytes:
        more += "\n(ruff's output was too long; some findings are missing: lint fewer paths)"
    if not findings:
        return f"no lint errors in {', '.join(targets)}.{note}{more}"
    root = ws.exec_root.rstrip("/") + "/"
    lines = []
    for f in findings[:MAX_FINDINGS]:
        loc = f.get("location") if isinstance(f.get("location"), dict) else {}
        lines.append(f"{str(f.get('filename', '?')).removeprefix(root)}:{loc.get('row')}:{loc.get('column')}: "
                     f"{f.get('code') or 'E'} {f.get('message')}")
    if len(findings) > MAX_FINDINGS:
        lines.append(f"[... {len(findings) - MAX_FINDINGS} more findings]")
    return truncate_middle(f"{len(findings)} lint finding(s):\n" + "\n".join(lines) + note + more,
                           ctx.max_output_bytes)


TOOLS = [
    Tool("read_lints", "Lint Python files with ruff and list the findings (path:line:col: CODE message).",
         params([], paths={"type": "array", "items": {"type": "string"},
                           "description": "Files or directories to lint. Default: the whole workspace."}),
         read_lints),
]
