"""`run_terminal`: shell commands in a session whose working directory and environment persist.

Each command runs as its own `bash` process in its own process group, started from the session's current
directory and exported environment; when it exits, an EXIT trap writes the new `pwd` and `env` back to the
session. This keeps what matters between calls (`cd`, `export`, activated virtualenvs) while making every
command killable as a unit: on timeout the whole process group gets SIGKILL and the session is unharmed.

What does **not** persist between calls: shell-local variables that were not exported, functions, aliases
and `set` options. Several `run_terminal` calls in **one** turn run concurrently, each in its own process
started from the session state as it was at the start of the turn; none of them writes state back (their
`cd`/`export` are discarded, and the model is told so), because concurrent writers would race.

`background: true` starts a long-lived process (a server, a watcher) that outlives the call; its output goes
to a log file the model can `tail`, and every background job is killed when the session closes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from shipyard.harness.tools.base import Tool, ToolContext, ToolError, params, truncate_middle
from shipyard.harness.workspace import Workspace, kill_group

DEFAULT_TIMEOUT = 120
MAX_TIMEOUT = 1800
# Variables bash maintains itself: carrying them over would be wrong (SHLVL would grow, PWD would lie).
SHELL_OWNED = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})
# Non-interactive defaults: no pagers waiting for a keypress, no colour codes wasting tokens.
QUIET_ENV = {"PAGER": "cat", "GIT_PAGER": "cat", "TERM": "dumb", "NO_COLOR": "1", "PYTHONDONTWRITEBYTECODE": "1"}

# $1: the command; $2: where to write the state (empty: do not persist).
WRAPPER = r"""
if [ -n "$2" ]; then trap 'status=$?; pwd -P > "$2.cwd"; env -0 > "$2.env"; exit $status' EXIT; fi
eval "$1"
"""


@dataclass
class Job:
    id: int
    command: str
    process: subprocess.Popen
    log: Path


class ShellSession:
    """Working directory, exported environment and background jobs of one agent episode."""

    def __init__(self, workspace: Workspace, env: dict[str, str] | None = None, max_output_bytes: int = 16_000):
        self.workspace = workspace
        self.max_output_bytes = max_output_bytes
        self.cwd: Path = workspace.root
        base = dict(os.environ) if env is None else dict(env)
        self.env = {k: v for k, v in base.items() if k not in SHELL_OWNED} | QUIET_ENV
        self.jobs: dict[int, Job] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="shipyard-shell-"))
        self._lock = threading.Lock()
        self._counter = 0

    def _next_id(self) -> int:
        with self._lock:
            self._counter += 1
            return self._counter

    def run(self, command: str, *, timeout: float, persist: bool = True) -> str:
        cwd = self.cwd if self.cwd.is_dir() else self.workspace.root
        state = self._dir / f"state{self._next_id()}" if persist else None
        argv = ["bash", "-c", WRAPPER, "bash", command, str(state) if state else ""]
        result = self.workspace.run(argv, timeout=timeout, cwd=cwd, env=self.env)
        text = (truncate_middle(result.output, self.max_output_bytes, result.dropped_bytes) if result.output
                else "(no output)\n")
        if not text.endswith("\n"):
            text += "\n"
        if result.timed_out:
            return text + (f"[timed out after {timeout:g} s; the command's process group was killed. Use a longer "
                           "`timeout`, or `background: true` for servers and watchers]")
        if state is not None and state.with_suffix(".cwd").exists():
            self._load_state(state)
        return text + f"[exit code {result.exit_code}]"

    def _load_state(self, state: Path) -> None:
        new_cwd = Path(state.with_suffix(".cwd").read_text().strip())
        raw = state.with_suffix(".env").read_bytes()
        env = {}
        for item in raw.split(b"\0"):
            key, sep, value = item.decode(errors="surrogateescape").partition("=")
            if sep and key not in SHELL_OWNED:
                env[key] = value
        with self._lock:
            self.cwd, self.env = new_cwd, env
        for suffix in (".cwd", ".env"):
            state.with_suffix(suffix).unlink(missing_ok=True)

    def start_job(self, command: str) -> Job:
        job_id = self._next_id()
        log = self._dir / f"job{job_id}.log"
        cwd = self.cwd if self.cwd.is_dir() else self.workspace.root
        proc = self.workspace.spawn(["bash", "-c", WRAPPER, "bash", command, ""], cwd=cwd, env=self.env, log=log)
        job = Job(job_id, command, proc, log)
        self.jobs[job_id] = job
        return job

    def close(self) -> None:
        for job in self.jobs.values():
            kill_group(job.process)
            job.process.wait()
        self.jobs.clear()
        shutil.rmtree(self._dir, ignore_errors=True)


def _session(ctx: ToolContext) -> ShellSession:
    with ctx.lock:
        if ctx.session is None:
            ctx.session = ShellSession(ctx.workspace, max_output_bytes=ctx.max_output_bytes)
        return ctx.session


def run_terminal(ctx: ToolContext, command: str, timeout: int = DEFAULT_TIMEOUT, background: bool = False) -> str:
    if not command.strip():
        raise ToolError("command is empty.")
    if not 1 <= timeout <= MAX_TIMEOUT:
        raise ToolError(f"timeout must be between 1 and {MAX_TIMEOUT} seconds.")
    session = _session(ctx)
    if background:
        job = session.start_job(command)
        return (f"started background job {job.id} (pid {job.process.pid}). Its output goes to {job.log}; "
                f"check it with run_terminal, e.g. `tail -n 50 {job.log}`. It is stopped when the session ends.")
    parallel = ctx.concurrent_terminals > 1
    out = session.run(command, timeout=timeout, persist=not parallel)
    if parallel:
        out += ("\n[ran concurrently with other run_terminal calls of this turn: changes to the working directory "
                "or environment made by this command are not kept]")
    return out


TOOLS = [
    Tool("run_terminal",
         "Run a bash command in the workspace. The working directory and exported variables persist between "
         "calls. Output (stdout+stderr) is truncated in the middle if long. Use background=true for servers.",
         params(["command"],
                command={"type": "string", "description": "The bash command line to run."},
                timeout={"type": "integer", "description": f"Seconds before the command is killed. "
                                                           f"Default {DEFAULT_TIMEOUT}."},
                background={"type": "boolean", "description": "Start it in the background and return at once."}),
         run_terminal, mutates=True),
]
