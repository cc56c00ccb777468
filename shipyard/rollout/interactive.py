"""One episode shown as it runs: what `shipyard agent` does once the model is loaded.

The agent's loop is the library's (`episode.run_on_repo`, the one RL trains); this module only adds the terminal:
each turn is printed as a panel when it ends (`harness.display`), a spinner runs while the model generates, and a
sandboxed run leaves its patch, trajectory and summary in a directory the user named. Kept out of the CLI so that
the command stays a shell over the library (docs/architecture.md) and the display can be driven by anything holding
a console.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from shipyard.harness.display import render_end, render_turn
from shipyard.harness.trajectory import Trajectory
from shipyard.models.engine import Engine
from shipyard.rollout.episode import EpisodeConfig, run_on_repo, save_artifacts
from shipyard.sandbox.host import host


def run_shown(task: str, repo: Path, engine: Engine, config: EpisodeConfig, console: Console, *,
              sandbox_dir: Path | None = None, out: Path | None = None) -> Trajectory:
    """Run one episode on `repo` and print it to `console` turn by turn. With `sandbox_dir`, the agent works in a
    sandbox over a snapshot of `repo` (never modified) and the patch, trajectory and summary are written there; else
    it edits `repo` in place and the trajectory goes to `out` if given (after every turn)."""
    if sandbox_dir is not None:
        for note in host().notes:
            console.print(f"[yellow]note:[/] {escape(str(note))}", soft_wrap=True)
        sandbox_dir.mkdir(parents=True, exist_ok=True)
        out = out or sandbox_dir / "trajectory.json"
    console.print(f"[dim]· tool calls without <tool_call> tags: {config.loop.untagged_calls}[/]")
    status = console.status("generating")

    def on_workspace(workspace) -> None:
        if sandbox_dir is not None:
            console.print(f"[dim]· sandbox {workspace.id} over a snapshot of {escape(str(repo))}; {escape(str(repo))} "
                          f"will not be modified[/]")

    def on_turn(turn, parsed) -> None:
        status.stop()
        console.print(render_turn(turn, parsed))
        status.start()

    with status:
        traj = run_on_repo(task, repo, engine, config, sandbox=sandbox_dir is not None, out=out, on_turn=on_turn,
                           on_workspace=on_workspace)
    render_end(console, traj)
    if sandbox_dir is not None:
        save_artifacts(traj, sandbox_dir)
        console.print(escape(f"patch, trajectory and summary written to {sandbox_dir}; apply the patch with "
                             f"`git apply {sandbox_dir / 'patch.diff'}` in {repo}"), style="dim", soft_wrap=True)
    elif out:
        console.print(escape(f"trajectory saved to {out}"), style="dim")
    return traj
