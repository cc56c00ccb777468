"""Opening what a run of episodes needs — the engine a model name denotes and the environment its sandboxes run in —
one way for every caller: `shipyard eval`, `shipyard train` and `shipyard demo` (`shipyard.rl.build`), and tests.

These choices used to live in the command line, where nothing else could reuse them; a benchmark that evaluated a
model had to repeat them, and could repeat them differently (`cli.py` is a thin shell: docs/architecture.md). What
each does:

* `select_tasks` — the tasks a run names (or all of a task set's), each loaded before the first episode: an unknown
  or malformed task is one clear error at the start, not a crash an hour into the run.
* `open_engine` — `shipyard.models.resolve.make_engine` for every model name it knows, plus `replay:gold`, which
  names no file: it replays the gold trajectory of each task being run (`shipyard.rollout.gold`), so only a caller
  that knows the task set can make it.
* `fit_turn_budget` — a replay engine replays each recorded message whole. A turn's token budget shorter than the
  longest message would cut that message (`finish_reason` "length") and replay something that was never recorded,
  so the budget is raised to the longest message plus its stop token. Other engines are left alone: their budget is
  the caller's choice.
* `open_environment` — bubblewrap sandboxes in this process (`LocalEnvironment`), once this host is known to be able
  to start them (a probe sandbox, `shipyard.sandbox.run.sandbox_problem`: otherwise every episode would fail the same
  way, each masked as an infrastructure failure, and the run would report nothing useful), or the sandboxes and
  grader of an environment server (`RemoteEnvironment` over `EnvClient`; the server must see the task set at the
  same path).

Model libraries (torch, transformers) are imported only when an engine is opened: a process that never opens one
(`shipyard eval --compare`, a usage error) starts without them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from shipyard.errors import UsageError, UserError

if TYPE_CHECKING:
    from shipyard.harness.loop import LoopConfig
    from shipyard.models.engine import Engine
    from shipyard.models.lora import LoraConfig
    from shipyard.models.vllm_server import VLLMConfig
    from shipyard.rollout.environment import Environment

GOLD = "replay:gold"


class SandboxesUnavailable(UserError, RuntimeError):
    """This host cannot start bubblewrap sandboxes; the message says why. Run episodes on an environment server."""


def select_tasks(tasks_dir: Path, only: Iterable[str] | None = None) -> list[str]:
    """The ids of the tasks to evaluate: `only` (duplicates dropped, order kept), else every task in the set. Each is
    loaded now, so that an unknown or malformed task is one `TaskFormatError` before the run, not a failure mid-run;
    UsageError when there is none."""
    from shipyard.tasks.taskset import list_tasks, load_task

    task_ids = list(dict.fromkeys(only)) if only else list_tasks(tasks_dir)
    for task_id in task_ids:
        load_task(tasks_dir, task_id)
    if not task_ids:
        raise UsageError(f"{tasks_dir} holds no tasks")
    return task_ids


def open_engine(model: str, *, tasks_dir: Path | None = None, task_ids: list[str] | None = None, device: str = "cpu",
                tokenizer: str | None = None, lora: LoraConfig | None = None,
                status: Callable[[str], None] = lambda _: None, loop: LoopConfig | None = None,
                pushes: bool = False, vllm: VLLMConfig | None = None) -> Engine:
    """The engine `model` denotes (`make_engine`'s names, and `replay:gold`: the gold trajectories of `task_ids` in
    `tasks_dir`, all of the task set's when None). `tokenizer` names the tokenizer of id-only engines (openai:,
    replay:); `lora` attaches a trainer's adapter to a local engine's model; `status` hears what loading is doing
    (downloads, conversions). With `loop`, the episodes' turn budget is fitted to a replay engine
    (`fit_turn_budget`), and a replay with a `tokenizer` encodes its messages as a policy writes them under the loop's
    `tags` (so its rollouts can be SFT demonstrations). With `pushes` (a training run), servers that cannot take
    weight pushes are refused now; a `vllm:` server is started with the settings of `vllm` (a run's [vllm]) when given.
    The caller closes the engine."""
    if model == GOLD:
        from shipyard.models.resolve import load_tokenizer
        from shipyard.rollout.gold import gold_engine

        if tasks_dir is None:
            raise UsageError(f"{GOLD} replays the gold patches of a task set: give the tasks directory")
        tok = load_tokenizer(tokenizer) if tokenizer else None
        encode = None
        if tok is not None and loop is not None:  # the replies as the policy would write them under the run's wire
            from shipyard.harness.tools import default_tools
            from shipyard.harness.wire import ChatFormat

            encode = ChatFormat(tok, default_tools(), tags=loop.tags).completion_ids
        engine = gold_engine(tasks_dir, task_ids, tok, encode=encode)
    else:
        from shipyard.models.resolve import make_engine

        context = {"max_tokens": loop.max_tokens} if loop is not None else {}  # what a vllm: server must hold
        engine = make_engine(model, device=device, tokenizer=tokenizer, lora=lora, status=status, pushes=pushes,
                             vllm=vllm, **context)
    if loop is not None and fit_turn_budget(engine, loop) is not None:
        status(f"a turn's token budget is raised to {loop.max_new_tokens}, the longest recorded message")
    return engine


def fit_turn_budget(engine: Engine, loop: LoopConfig) -> int | None:
    """Raise `loop.max_new_tokens` so that a replay engine's longest recorded message is replayed whole (see the
    module docstring); the new budget, or None when it was left as it was."""
    from shipyard.models.replay import ReplayEngine

    if not isinstance(engine, ReplayEngine) or engine.longest() + 1 <= loop.max_new_tokens:
        return None
    loop.max_new_tokens = engine.longest() + 1  # + the stop token the engine ends a replayed message with
    return loop.max_new_tokens


def open_environment(env_server: str | None = None) -> Environment:
    """Where episodes run: bubblewrap sandboxes in this process (`SandboxesUnavailable` when this host cannot start
    them), or with `env_server` (http://HOST:PORT) that environment server's. The caller closes it."""
    if env_server is not None:
        from shipyard.rollout.remote import RemoteEnvironment
        from shipyard.sandbox.client import EnvClient

        return RemoteEnvironment(EnvClient(env_server))
    from shipyard.rollout.environment import LocalEnvironment

    check_sandboxes()
    return LocalEnvironment()


def check_sandboxes() -> None:
    """`SandboxesUnavailable` unless this host can start a bubblewrap sandbox (it starts a probe: ~50 ms)."""
    from shipyard.sandbox.run import sandbox_problem

    problem = sandbox_problem()
    if problem:
        raise SandboxesUnavailable(f"this host cannot start bubblewrap sandboxes: {problem}")
