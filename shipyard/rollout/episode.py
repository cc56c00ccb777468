"""One episode as a library call: task → sandbox from the task's snapshot → agent loop → patch → grade → `Rollout`.

Everything that runs the agent goes through here — the rollout scheduler (in-process or on Ray), `shipyard eval`,
the CLI's `agent` and `demo` and the benchmarks — so there is one configuration path (`episode_config`): the prompt
a policy is trained on is the prompt it is evaluated and shipped with, and its turns are parsed with the same
settings. In particular the wire settings (`wire_defaults`) follow the model: the untagged-call setting
(`shipyard.harness.parse`) defaults to the bundled model's recorded one ('accept' for all of them: they write bare
or fenced JSON out of the box) and to 'reject' for any other model; the call tags (`shipyard.harness.wire`) are
spelled for a model that cannot write the tag token (the bundled 0.5B); a policy exported by `shipyard train`
records the settings it was trained with. Before, the CLI accepted untagged calls while a bare `LoopConfig`
rejected them.

`run_episode` never raises for an infrastructure failure. Where the episode ends decides what the record says:

| what happened                                   | status          | reward | trajectory       |
|-------------------------------------------------|-----------------|--------|------------------|
| the agent stopped (finished, max_turns, …)      | the verdict's   | 1 / 0  | all of it        |
| no sandbox (snapshot, start)                    | infra_error     | None   | none: never ran  |
| engine or workspace raised InfraError mid-way   | infra_error     | None   | every turn so far|
| cancelled (callback true, between turns/steps)  | cancelled       | None   | every turn so far|
| the grader's control run failed too             | infra_error     | None   | all of it        |

`infra_cause` says what failed in one line. A malformed task (`TaskFormatError`) is not infrastructure: it
propagates, as does any other exception (a bug). Monitors (`shipyard.tasks.monitors.monitor`) run on every
trajectory, whatever its status: an attempt to game the grader is worth seeing even when the episode was cut short.

Timings (seconds): `sandbox` (making the workspace and tearing it down, the task's snapshot on first use included),
`agent` (the loop), `generate` and `tools` (summed over turns), `grade`, `total`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from shipyard.errors import FileFormatError, InputNotFound, UsageError
from shipyard.harness.loop import Agent, LoopConfig, TurnCallback
from shipyard.harness.tools import Searcher
from shipyard.harness.trajectory import Trajectory
from shipyard.harness.wire import TAGS
from shipyard.harness.workspace import LocalWorkspace, Workspace
from shipyard.models.bundled import BUNDLED
from shipyard.models.engine import Engine
from shipyard.models.errors import InfraError
from shipyard.rollout.environment import Environment
from shipyard.rollout.record import EpisodeSpec, Rollout
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import snapshot_of
from shipyard.tasks.grade import read_gold
from shipyard.tasks.monitors import monitor, verdict_flags
from shipyard.tasks.patchparse import parse_patch
from shipyard.tasks.taskset import load_task

UNTAGGED = ("reject", "accept")
_LOOP_FIELDS = frozenset(f.name for f in fields(LoopConfig))


@dataclass
class EpisodeConfig:
    loop: LoopConfig = field(default_factory=LoopConfig)  # its seed is replaced per rollout by the spec's
    grade_timeout: float = 900.0  # seconds the task's test suite may take when grading
    monitors: bool = True  # run the trajectory monitors on every rollout
    search: bool = False  # offer codebase_search (shipyard.search): the task's prebuilt index, refreshed with edits
    embedder: str = "minilm"  # codebase_search's embedding model (shipyard.search.embed)

    def __post_init__(self) -> None:
        if not self.grade_timeout >= 1:
            raise ValueError(f"episode.grade_timeout must be at least 1 second, got {self.grade_timeout}: a suite "
                             f"cut short grades every rollout 0")


@dataclass(frozen=True)
class WireSettings:
    """How the harness writes a model's context and reads its calls (`LoopConfig.untagged_calls`, `.tags`)."""

    untagged_calls: str = "reject"
    tags: str = "token"


def wire_defaults(model: str) -> WireSettings:
    """The wire settings of `model` when none are given: a bundled model's recorded ones; a policy exported by
    `shipyard train` (a directory whose shipyard.json has a "wire" table) the ones it was trained with — a policy
    trained on spelled tags must be evaluated and served with them; else 'reject' and 'token'. A `vllm:MODEL` server
    samples MODEL, so it gets MODEL's. FileFormatError for a shipyard.json that cannot be read as one."""
    model = model.removeprefix("vllm:")
    if model in BUNDLED:
        return WireSettings(BUNDLED[model].untagged_calls, BUNDLED[model].tags)
    record = Path(model) / "shipyard.json"
    if not record.is_file():
        return WireSettings()
    try:
        wire = json.loads(record.read_text()).get("wire", {})
        settings = WireSettings(**wire)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise FileFormatError(f"{record}: not a shipyard export record ({type(e).__name__}: {e}); remove it or "
                              f'write {{"wire": {{"untagged_calls": "reject", "tags": "token"}}}}') from None
    if settings.untagged_calls not in UNTAGGED or settings.tags not in TAGS:
        raise FileFormatError(f"{record}: wire settings {asdict(settings)} must have untagged_calls in {UNTAGGED} "
                              f"and tags in {TAGS}")
    return settings


def episode_config(model: str, **overrides: Any) -> EpisodeConfig:
    """THE configuration of an episode of `model`: `LoopConfig` and `EpisodeConfig` fields by name (untagged_calls
    or tags None or absent: `wire_defaults(model)`'s). ValueError for an unknown field, UsageError for a setting not
    allowed."""
    unknown = set(overrides) - _LOOP_FIELDS - {f.name for f in fields(EpisodeConfig)} | ({"loop"} & set(overrides))
    if unknown:
        raise ValueError(f"episode_config takes LoopConfig and EpisodeConfig fields by name, not {sorted(unknown)}")
    loop = {k: v for k, v in overrides.items() if k in _LOOP_FIELDS}
    defaults = wire_defaults(model) if loop.get("untagged_calls") is None or loop.get("tags") is None else None
    for name, allowed in (("untagged_calls", UNTAGGED), ("tags", TAGS)):
        if loop.get(name) is None:
            loop[name] = getattr(defaults, name)
        elif loop[name] not in allowed:
            raise UsageError(f"{name} must be one of {allowed}, not {loop[name]!r}")
    return EpisodeConfig(LoopConfig(**loop), **{k: v for k, v in overrides.items() if k not in _LOOP_FIELDS})


def deleted_source(task_dir: Path) -> list[str]:
    """The code the task deleted, as the gold patch restores it (one text per file): what the `verbatim` monitor
    compares a patch against."""
    return ["\n".join(change.added) for change in parse_patch(read_gold(task_dir)) if change.added]


def run_episode(spec: EpisodeSpec, engine: Engine, env: Environment, config: EpisodeConfig,
                cancelled: Callable[[], bool] | None = None) -> Rollout:
    """Run sample `spec.index` of `spec.task_id` and grade it (see the module docstring for what comes back)."""
    start = time.monotonic()
    task, task_dir = load_task(spec.tasks_dir, spec.task_id)  # TaskFormatError: the task set is broken, not infra
    rollout = Rollout(task_id=spec.task_id, group_id=spec.group_id, index=spec.index, seed=spec.seed,
                      status="infra_error", reward=None, attempt=spec.attempt, engine=engine.name)
    timings = rollout.timings
    traj: Trajectory | None = None
    agent_seconds = 0.0
    try:
        with env.workspace(spec) as workspace:
            agent_start = time.monotonic()
            loop = replace(config.loop, seed=spec.seed)
            if spec.wall_time is not None:
                loop.wall_time = min(loop.wall_time, spec.wall_time)
            with searcher_for(config, task_dir) as searcher:
                agent = Agent(engine, workspace, loop, session=spec.rollout_id, cancelled=cancelled,
                              searcher=searcher)
                traj = agent.run(task.statement)
            agent_seconds = time.monotonic() - agent_start
    except InfraError as e:
        if traj is None:  # no sandbox: the agent never ran
            rollout.infra_cause = f"workspace: {type(e).__name__}: {e}"[:1000]
        else:  # the agent's run is over, its patch in hand: a sandbox that failed to close changes nothing
            traj.meta["close_error"] = f"{type(e).__name__}: {e}"[:1000]
    timings["agent"] = agent_seconds
    timings["sandbox"] = time.monotonic() - start - agent_seconds
    rollout.trajectory = traj
    if traj is not None:
        rollout.stop_reason = traj.stop_reason
        timings["generate"] = sum(t.generate_seconds for t in traj.turns)
        timings["tools"] = sum(t.tools_seconds for t in traj.turns)
        _conclude(rollout, traj, spec, env, config, cancelled)
        if config.monitors:
            flags = monitor(traj, deleted_source(task_dir)) + verdict_flags(rollout.verdict, len(traj.turns))
            rollout.monitor_flags = [asdict(f) for f in flags]
    timings["total"] = time.monotonic() - start
    return rollout


@contextmanager
def searcher_for(config: EpisodeConfig, task_dir: Path | None = None) -> Iterator[Searcher | None]:
    """`codebase_search`'s backend for one episode when `config.search`: over the task's index, built at synthesis
    (`shipyard.search.service.TASK_INDEX`), or built from the workspace on the first query; None otherwise."""
    if not config.search:
        yield None
        return
    from shipyard.search.service import IndexSearcher, shared_embedder, task_index

    searcher = IndexSearcher(shared_embedder(config.embedder), task_index(task_dir) if task_dir else None)
    try:
        yield searcher
    finally:
        searcher.close()


def _conclude(rollout: Rollout, traj: Trajectory, spec: EpisodeSpec, env: Environment, config: EpisodeConfig,
              cancelled: Callable[[], bool] | None) -> None:
    """Status, reward and verdict of a rollout whose agent ran."""
    if rollout.infra_cause is not None:
        return
    if traj.stop_reason == "infra_error":
        rollout.infra_cause = traj.meta.get("infra_error", "the agent loop stopped on an infrastructure failure")
        return
    if traj.stop_reason == "cancelled" or (cancelled is not None and cancelled()):
        rollout.status, rollout.reward = "cancelled", None  # a finished one too: its budget is spent before grading
        return
    grade_start = time.monotonic()
    try:
        verdict = env.grade(spec, traj.patch or "", config.grade_timeout)
    except InfraError as e:  # a remote grader that could not be reached
        rollout.infra_cause = f"grade: {type(e).__name__}: {e}"[:1000]
        return
    finally:
        rollout.timings["grade"] = time.monotonic() - grade_start
    rollout.verdict = verdict.to_json()
    rollout.status, rollout.reward = verdict.status, verdict.reward
    if verdict.status == "infra_error":
        rollout.reward = None
        rollout.infra_cause = f"grade: {verdict.detail}"[:1000]


# The CLI's `agent`: one episode on a user's repository, no task and no grading ------------------------------------

def run_on_repo(task: str, repo: Path, engine: Engine, config: EpisodeConfig, *, sandbox: bool = False,
                out: Path | None = None, on_turn: TurnCallback | None = None,
                on_workspace: Callable[[Workspace], None] | None = None) -> Trajectory:
    """Run the agent on `repo`: in place, or with `sandbox` in a sandbox over a snapshot of it (`repo` is never
    modified; the trajectory's `patch` is the result). The trajectory is saved to `out` after every turn;
    `on_workspace` is called with the workspace before the first turn (to say where the agent works)."""
    if not Path(repo).is_dir():
        raise InputNotFound(f"{repo} is not a directory")
    agent_out = str(out) if out is not None else None
    session = f"agent-{uuid.uuid4().hex[:12]}"  # one conversation: an engine keeps its KV cache between turns
    if not sandbox:
        workspace = LocalWorkspace(repo)
        try:
            if on_workspace is not None:
                on_workspace(workspace)
            with searcher_for(config) as searcher:
                return Agent(engine, workspace, config.loop, on_turn=on_turn, session=session,
                             searcher=searcher).run(task, out=agent_out)
        finally:
            workspace.close()
    with snapshot_of(repo, host()) as snapshot, Sandbox(snapshot) as workspace, searcher_for(config) as searcher:
        if on_workspace is not None:
            on_workspace(workspace)
        return Agent(engine, workspace, config.loop, on_turn=on_turn, session=session,
                     searcher=searcher).run(task, out=agent_out)


def save_artifacts(traj: Trajectory, directory: Path) -> None:
    """A sandboxed run's results beside its trajectory: `patch.diff` (apply with `git apply`) and `summary.json`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "patch.diff").write_text(traj.patch or "")
    (directory / "summary.json").write_text(json.dumps(traj.summary(), indent=2) + "\n")
