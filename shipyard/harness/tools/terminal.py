"""`run_terminal`: shell commands in a session whose working directory and environment persist.

Each command runs as its own `bash` process in its own process group, started from the session's current
directory and exported environment; when it exits, an EXIT trap prints a random per-call marker followed by
the new `pwd` and `env`, which the session strips from the output and keeps. This keeps what matters between
calls (`cd`, `export`, activated virtualenvs) while making every command killable as a unit: on timeout the
whole process group gets SIGKILL and the session is unharmed. The state travels on the output stream rather
than through files, so the session works unchanged over any workspace, a sandbox included.

**The project's environment comes first.** When the workspace root holds a virtual environment (`.venv`, as every
task's snapshot does), the session starts with it active: its `bin` first on `PATH` and `VIRTUAL_ENV` set, so
`python`, `pytest` and `pip` are the project's, as for a developer who activated it. Without that, they were those of
the environment shipyard runs in (first on a sandbox's `PATH`, for the harness's own tools), where the project is not
installed: every test module failed with an ImportError. shipyard's tools (`rg`, `ruff`) stay reachable behind it,
and shadow nothing the project's environment has. A workspace without `.venv` keeps the environment it has.

What does **not** persist between calls: shell-local variables that were not exported, functions, aliases
and `set` options. Several `run_terminal` calls in **one** turn run concurrently, each in its own process
started from the session state as it was at the start of the turn; none of them writes state back (their
`cd`/`export` are discarded, and the model is told so), because concurrent writers would race.

`background: true` starts a long-lived process (a server, a watcher) that outlives the call; its output goes
to a log file the model can `tail`, and every background job is killed when the session closes.
"""

from __future__ import annotations

import secrets
import threading

from shipyard.harness.process import Job
from shipyard.harness.tools.base import Tool, ToolContext, ToolError, params, plain_text, truncate_middle
from shipyard.harness.workspace import Workspace

DEFAULT_TIMEOUT = 120
MAX_TIMEOUT = 1800
# The command is one argv string, and Linux caps one argument at 128 KiB (MAX_ARG_STRLEN).
MAX_COMMAND_BYTES = 100_000
# Variables bash maintains itself: carrying them over would be wrong (SHLVL would grow, PWD would lie).
SHELL_OWNED = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})
# Non-interactive defaults: no pagers waiting for a keypress, no colour codes wasting tokens.
VENV = ".venv"  # the project's virtual environment, at the workspace root (a task's: shipyard.tasks.environment)
QUIET_ENV = {"PAGER": "cat", "GIT_PAGER": "cat", "TERM": "dumb", "NO_COLOR": "1", "PYTHONDONTWRITEBYTECODE": "1"}

# $1: the command; $2: the marker that precedes the saved state (empty: do not report state).
# fd 9 keeps the original stdout, so the state is reported even if the command redirects its own output.
WRAPPER = r"""
exec 9>&1
if [ -n "$2" ]; then
  trap 'status=$?; { printf "\n%s\n" "$2"; pwd -P; printf "\0"; env -0; } >&9; exit $status' EXIT
fi
eval "$1"
"""


def activated(workspace: Workspace, env: dict[str, str]) -> dict[str, str]:
    """`env` with the workspace's own virtual environment active, when its root holds one (`.venv/pyvenv.cfg`): its
    `bin` first on `PATH` and `VIRTUAL_ENV` set, as `source .venv/bin/activate` does (module docstring). Otherwise
    `env` unchanged."""
    if workspace.kind(f"{VENV}/pyvenv.cfg") != "file" or workspace.kind(f"{VENV}/bin") != "dir":
        return env
    venv = f"{workspace.exec_root.rstrip('/')}/{VENV}"
    path = [d for d in env.get("PATH", "").split(":") if d and d != f"{venv}/bin"]
    out = {k: v for k, v in env.items() if k != "PYTHONHOME"}  # a PYTHONHOME would point python elsewhere
    return out | {"VIRTUAL_ENV": venv, "PATH": ":".join([f"{venv}/bin", *path])}


class ShellSession:
    """Working directory, exported environment and background jobs of one agent episode."""

    def __init__(self, workspace: Workspace, env: dict[str, str] | None = None, max_output_bytes: int = 16_000):
        self.workspace = workspace
        self.max_output_bytes = max_output_bytes
        self.cwd: str = workspace.exec_root
        base = workspace.environment() if env is None else dict(env)
        self.env = activated(workspace, {k: v for k, v in base.items() if k not in SHELL_OWNED}) | QUIET_ENV
        self.jobs: list[Job] = []
        self._lock = threading.Lock()

    def run(self, command: str, *, timeout: float, persist: bool = True) -> str:
        marker = f"@@shipyard-state-{secrets.token_hex(16)}@@"
        argv = ["bash", "-c", WRAPPER, "bash", command, marker if persist else ""]
        try:
            result = self.workspace.run(argv, timeout=timeout, cwd=self.cwd, env=self.env)
        except FileNotFoundError:  # the working directory was deleted by an earlier command
            self.cwd = self.workspace.exec_root
            result = self.workspace.run(argv, timeout=timeout, cwd=self.cwd, env=self.env)
        output = result.output
        if persist and not result.timed_out:
            cut = output.rfind(f"\n{marker}\n".encode())
            if cut != -1:
                self._load_state(output[cut + len(marker) + 2:])
                output = output[:cut]
        text = (truncate_middle(output, self.max_output_bytes, result.dropped_bytes) if output
                else "(no output)")
        if not text.endswith("\n"):
            text += "\n"
        if result.timed_out:
            return text + (f"[timed out after {timeout:g} s; the command's process group was killed. Use a longer "
                           "`timeout`, or `background: true` for servers and watchers]")
        return text + f"[exit code {result.exit_code}]"

    def _load_state(self, state: bytes) -> None:
        cwd, _, raw_env = state.partition(b"\0")
        env = {}
        for item in raw_env.split(b"\0"):
            key, sep, value = item.decode(errors="surrogateescape").partition("=")
            if sep and key and key not in SHELL_OWNED:  # an empty name would make every later exec fail
                env[key] = value
        with self._lock:
            self.cwd, self.env = cwd.decode(errors="surrogateescape").strip(), env

    def start_job(self, command: str) -> Job:
        job = self.workspace.spawn(["bash", "-c", 'eval "$1"', "bash", command], cwd=self.cwd, env=self.env)
        self.jobs.append(job)
        return job

    def close(self) -> None:
        for job in self.jobs:
            job.stop()
        self.jobs.clear()


def _session(ctx: ToolContext) -> ShellSession:
    with ctx.lock:
        if ctx.session is None:
            ctx.session = ShellSession(ctx.workspace, max_output_bytes=ctx.max_output_bytes)
        return ctx.session


def run_terminal(ctx: ToolContext, command: str, timeout: int = DEFAULT_TIMEOUT, background: bool = False) -> str:
    if not command.strip():
        raise ToolError("command is empty.")
    size = len(plain_text(command, "command").encode())
    if size > MAX_COMMAND_BYTES:
        raise ToolError(f"the command is {size} bytes, more than the {MAX_COMMAND_BYTES} one command may be; write "
                        "a script with write_file and run that.")
    if not 1 <= timeout <= MAX_TIMEOUT:
        raise ToolError(f"timeout must be between 1 and {MAX_TIMEOUT} seconds.")
    session = _session(ctx)
    if background:
        job = session.start_job(command)
        return (f"started background job {job.id} (pid {job.pid}). Its output goes to {job.log}; "
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
