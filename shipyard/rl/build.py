"""From a resolved configuration (`shipyard.rl.config.RLConfig`) to a running loop: the task set (synthesized on the
first run when the config names a repository), the held-out split, the engine, the sandboxes, the transport, the
scheduler, the trainer and the run directory.

`open_run(config)` is a context manager: it builds everything, yields the `RLLoop`, and on exit closes what it
opened (the engine's thread, the sandboxes' task snapshots, Ray actors through the transport) whatever happened. The
engines and the sandboxes are opened as for every other command (`shipyard.rollout.setup`): a run whose episodes run
in this process first checks that this host can start sandboxes, so a host that cannot is one clear error before any
work, not a run whose every episode fails. The held-out tasks are chosen once, with `run.seed`, and recorded in the
run's config: they are evaluated, never trained on. A resumed run (`run.resume`) reopens the run directory and
continues from its latest checkpoint; a new run refuses a directory in use. Whatever ends a run once its directory
exists — a mistake or a bug, while building or in the loop — marks it failed there, with the traceback in
RUN/error.txt (`RunDir.fail`).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

from shipyard.errors import UserError
from shipyard.harness.tools import default_tools
from shipyard.harness.wire import ChatFormat, tag_token_twins
from shipyard.models.nccl import NOT_FOR_LORA
from shipyard.models.resolve import load_tokenizer, model_directory
from shipyard.models.vllm_server import VLLMConfig
from shipyard.rl.config import ConfigError, RLConfig, engine_spec, save_config
from shipyard.rl.critic import Critic
from shipyard.rl.hints import HintWriter
from shipyard.rl.loop import RLLoop, export_policy
from shipyard.rl.ranks import RankSpec, trainer_ranks
from shipyard.rl.rundir import RunDir
from shipyard.rollout.advantages import (
    EffortCalibration,
    GroundedCalls,
    GroupShapingTerm,
    HackPenalty,
    ParallelBonus,
    ShapingTerm,
)
from shipyard.rollout.environment import Environment
from shipyard.rollout.episode import WireSettings, wire_defaults
from shipyard.rollout.scheduler import Scheduler
from shipyard.rollout.setup import open_engine, open_environment
from shipyard.rollout.transport import InProcessTransport
from shipyard.tasks.curriculum import Curriculum
from shipyard.tasks.taskset import list_tasks, load_task, project_name, task_projects
from shipyard.train.checkpoint import latest_checkpoint
from shipyard.train.trainer import TrainConfig, Trainer

Status = Callable[[str], None]


def task_set(config: RLConfig, status: Status) -> Path:
    """The run's task set: `run.tasks` if it holds tasks, else synthesized there from `run.synth_from`."""
    tasks = config.run.tasks
    if tasks.is_dir() and list_tasks(tasks):
        return tasks
    if config.run.synth_from is None:
        raise ConfigError(f"run.tasks {tasks} holds no tasks and run.synth_from names no repository to make them "
                          f"from: run `shipyard synth --repo REPO --out {tasks}` or set run.synth_from")
    from shipyard.tasks.synth import Synthesizer

    status(f"synthesizing tasks from {config.run.synth_from} into {tasks}")
    report = Synthesizer(config.run.synth_from, tasks, config.synth, log=lambda m: status(f"· {m}")).run()
    if not report.accepted:
        rejections = report.to_json()["rejections"]
        raise UserError(f"no task could be synthesized from {config.run.synth_from} (rejections: {rejections}): "
                        f"see docs/tasks.md for what a repository needs")
    return tasks


def held_out(config: RLConfig, task_ids: list[str], projects: dict[str, str] | None = None) -> list[str]:
    """The evaluation tasks: `run.held_out` and every task of `run.held_out_projects` (`projects`: task id → its
    project's name), or `run.held_out_count` chosen with `run.seed`."""
    if config.run.held_out or config.run.held_out_projects:
        unknown = sorted(set(config.run.held_out) - set(task_ids))
        if unknown:
            raise ConfigError(f"run.held_out names tasks the task set does not have: {unknown}")
        names = {project_name(p) for p in config.run.held_out_projects}
        known = set((projects or {}).values())
        if names - known:
            raise ConfigError(f"run.held_out_projects names projects the task set has no task of: "
                              f"{sorted(names - known)}; its projects: {sorted(known)}")
        chosen = list(dict.fromkeys([*config.run.held_out, *(t for t in task_ids if (projects or {}).get(t) in names)]))
    else:
        chosen = sorted(random.Random(config.run.seed).sample(sorted(task_ids), config.run.held_out_count)) \
            if config.run.held_out_count <= len(task_ids) else task_ids
    if len(chosen) >= len(task_ids):
        raise ConfigError(f"run.held_out leaves no task to train on ({len(task_ids)} tasks, {len(chosen)} held out): "
                          f"hold out fewer or synthesize more (synth.max_tasks)")
    return chosen


def split(config: RLConfig, tasks_dir: Path) -> tuple[Curriculum, list[str]]:
    """(the training curriculum, the held-out tasks): the curriculum is built from the task set without the held-out
    ids, so no held-out task, and no task of a held-out project, can be sampled for training. The held-out tasks are
    `held_out`'s and every task that deletes code one of them deletes (`sharing_code`)."""
    task_ids = list_tasks(tasks_dir)
    evals = held_out(config, task_ids, task_projects(tasks_dir) if config.run.held_out_projects else None)
    evals += sharing_code(tasks_dir, task_ids, evals)
    if len(evals) >= len(task_ids):
        raise ConfigError(f"run.held_out leaves no task to train on: the {len(evals)} held-out tasks, with those that "
                          f"delete the same code, are all {len(task_ids)}; hold out fewer or synthesize more")
    return Curriculum.from_taskset(tasks_dir, config.curriculum, exclude=set(evals)), evals


def sharing_code(tasks_dir: Path, task_ids: list[str], held: list[str]) -> list[str]:
    """The tasks of `task_ids` outside `held` that delete a symbol (project, file, qualified name) a held-out task
    deletes, or one that such a task deletes, and so on. Tiers share symbols — a tier-1 task empties `f`'s body, a
    tier-3 task removes `f` whole, a tier-2 task deletes `f` with `g` — so training on any of them is training on the
    answer of the held-out task; only a split closed this way keeps the held-out evaluation a measure of tasks never
    trained on."""
    symbols = {}
    for task_id in task_ids:
        task, _ = load_task(tasks_dir, task_id)
        symbols[task_id] = {(task.project.name, d.file, d.qualname) for d in task.deleted}
    taken = set().union(*(symbols[t] for t in held))
    out: list[str] = []
    while more := [t for t in task_ids if t not in held and t not in out and symbols[t] & taken]:
        out += more
        taken |= set().union(*(symbols[t] for t in more))
    return out


def shaping_terms(config: RLConfig) -> tuple[ShapingTerm, ...]:
    """The configured shaping terms, in the order they are applied (`[shaping]`, `run.zero_flagged`)."""
    s = config.shaping
    terms: list[ShapingTerm] = []
    if s.grounded or s.placeholder:
        terms.append(GroundedCalls(s.grounded, s.placeholder, tuple(default_tools()), s.untagged_credit,
                                   s.grounded_target))
    if s.parallel:
        terms.append(ParallelBonus(s.parallel))
    if config.run.zero_flagged:
        terms.append(HackPenalty(floor=-s.placeholder))  # the lowest total a clean rollout can get
    return tuple(terms)


def group_shaping_terms(config: RLConfig) -> tuple[GroupShapingTerm, ...]:
    """The configured group-level shaping terms (`[shaping] effort…`)."""
    s = config.shaping
    if not s.effort:
        return ()
    return (EffortCalibration(s.effort, s.effort_turn_tokens, tuple(s.effort_tier_scale)),)


def run_dir(config: RLConfig) -> RunDir:
    if not config.run.resume:
        return RunDir.create(config.run.dir, keep=[config.run.tasks])
    checkpoint = latest_checkpoint(Path(config.run.dir) / "checkpoints")
    step = 0 if checkpoint is None else int(checkpoint.name.split("-")[1])
    return RunDir.resume(config.run.dir, step)


def trainer_config(config: RLConfig) -> TrainConfig:
    """The trainer's configuration as a run builds it: distillation (and so the teacher, for an EMA teacher a second
    copy of the model) exactly when hints can arrive."""
    if config.hints.enabled and config.trainer.distill.weight <= 0:
        raise ConfigError("hints.enabled distils the hinted turns with weight trainer.distill.weight, which is 0: set "
                          "trainer.distill.weight > 0 (default 1.0), or hints.enabled = false")
    return replace(config.trainer, distill=replace(config.trainer.distill, enabled=config.hints.enabled))


def check_engine(config: RLConfig) -> None:
    """Engine settings that do not go together (`ConfigError`)."""
    if config.engine.kind == "vllm" and config.vllm.transfer == "nccl":
        if config.ray is not None:
            raise ConfigError("vllm.transfer = \"nccl\" broadcasts from the trainer's GPU into servers it starts on "
                              "this machine (vllm.gpus) or that you run (vllm.urls); with [ray] the engine actors "
                              "start the servers: set vllm.transfer = \"disk\"")
        if config.trainer.lora.enabled:
            raise ConfigError(NOT_FOR_LORA)
        if config.run.device != "cuda":
            raise ConfigError("vllm.transfer = \"nccl\" broadcasts from the trainer's rank 0 on cuda:0: set run.device "
                              "= \"cuda\", or vllm.transfer = \"disk\"")
        if 0 in config.vllm.gpus:
            raise ConfigError("vllm.transfer = \"nccl\": vllm.gpus holds GPU 0, the trainer's rank 0, which broadcasts "
                              "the weights; NCCL takes no two ranks of a group on one GPU: give the servers other GPUs")
    if config.ray is not None and config.engine.kind == "vllm" and (config.vllm.urls or config.vllm.servers != 1
                                                                     or config.vllm.gpus):
        raise ConfigError("with [ray], each of ray.engines engine actors starts one vLLM server on its node, on the "
                          "GPUs Ray gives it (ray.engine_gpus; none: the CPU): leave vllm.servers at 1, vllm.gpus and "
                          "vllm.urls empty, and set ray.engines")
    if config.engine.kind == "vllm":
        vllm_settings(config)


def vllm_settings(config: RLConfig) -> VLLMConfig:
    """`[vllm]` with its context length fitted to the episodes': by default their budget (`episode.loop.max_tokens`);
    a shorter one is refused, or every conversation that grows past it would fail mid-run with a 400."""
    budget = config.episode.loop.max_tokens
    if config.vllm.max_model_len and config.vllm.max_model_len < budget:
        raise ConfigError(f"vllm.max_model_len = {config.vllm.max_model_len} is shorter than the episodes' context "
                          f"budget episode.loop.max_tokens = {budget}: raise the first or lower the second")
    return replace(config.vllm, max_model_len=config.vllm.max_model_len or budget)


def _wired_loop(config: RLConfig, run: RunDir, tasks_dir: Path, evals: list[str], curriculum: Curriculum,
                env: Environment | None, stack: ExitStack, status: Status, argv: list[str] | None) -> RLLoop:
    """The engine, transport, trainer ranks, scheduler and hint writer of a run whose directory is open, wired into
    its `RLLoop` (episodes run in `env`, or on Ray when `env` is None); what must be closed goes on `stack`."""
    save_config(config, run.config_path, note="shipyard train " + " ".join(argv or []))

    status(f"loading {config.model.name}")
    name, kwargs = engine_spec(config)
    check_engine(config)
    if config.ray is not None:  # the engines are Ray actors, made by the transport
        from shipyard.rollout.ray_transport import RayTransport

        tokenizer = load_tokenizer(config.model.tokenizer or config.model.name, status)
        vllm = None
        if config.engine.kind == "vllm":  # a server per engine actor, started on its node
            served = config.vllm.model or model_directory(config.model.name, status)
            name, vllm = f"vllm:{served}", vllm_settings(config)
        transport = RayTransport(name, config.episode, config.ray, lora=kwargs["lora"], vllm=vllm)
    else:
        if config.engine.kind == "vllm":  # servers of the run, started here and stopped with it
            from shipyard.models.vllm_server import managed_engine

            served = config.vllm.model or model_directory(config.model.name, status)
            engine = stack.enter_context(managed_engine(
                vllm_settings(config), served, run.root / "vllm",
                load_tokenizer(config.model.tokenizer or str(served), status), status, lora=config.trainer.lora))
        else:
            engine = open_engine(name, tasks_dir=tasks_dir, **kwargs, status=status, pushes=True)
            stack.callback(engine.close)
        tokenizer = engine.tokenizer or load_tokenizer(config.model.tokenizer or config.model.name, status)
        workers = config.rollout.max_in_flight or config.rollout.group_size * config.rollout.groups_per_step
        transport = InProcessTransport(engine, env, config.episode, workers)
    loop = config.episode.loop
    chat = ChatFormat(tokenizer, default_tools(), tags=loop.tags)  # the hints: as the episodes write the tags
    header = tuple(chat.assistant_header_ids())
    spec = RankSpec.of(config, tokenizer.pad_token_id, header)
    group = stack.enter_context(trainer_ranks(spec, status))
    twins = tag_token_twins(group.model, tokenizer)
    if loop.tags == "token" and twins is not None and len(twins) >= 2:
        status(f"warning: {config.model.name}'s output row of <tool_call> equals those of {', '.join(twins[:3])}, "
               f"…: never trained, the policy cannot write the tag token; set episode.loop.tags = \"spelled\"")
    trainer = Trainer(group.model, spec.trainer, pad_id=tokenizer.pad_token_id, header_ids=header,
                      device=group.device)
    shaping = shaping_terms(config)
    scheduler = Scheduler(copy.deepcopy(config.rollout), transport, tasks_dir, curriculum, shaping=shaping,
                          group_shaping=group_shaping_terms(config))
    hints = None
    if config.hints.enabled:
        critic = None
        if config.hints.critic:
            status(f"loading the critic {config.hints.critic}")
            critic_engine = open_engine(config.hints.critic, device=config.engine.device,
                                        tokenizer=config.hints.critic_tokenizer, status=status)
            stack.callback(critic_engine.close)
            critic = Critic(critic_engine, max_hints=config.hints.critic_max_hints,
                            tags=wire_defaults(config.hints.critic).tags).review
        hints = HintWriter(tasks_dir, chat, max_turns=config.hints.max_turns,
                           verbose_words=config.hints.verbose_words, detectors=config.hints.detectors,
                           critic=critic)
    wire = WireSettings(loop.untagged_calls, loop.tags)
    return RLLoop(scheduler, trainer, run, config.run, eval_tasks=evals if config.run.evaluate else [], hints=hints,
                  export=lambda t, full, d: export_policy(t, full, tokenizer, d, wire), ranks=group.ranks(trainer))


@contextmanager
def open_run(config: RLConfig, *, status: Status = lambda _: None, argv: list[str] | None = None) -> Iterator[RLLoop]:
    """Everything the configuration describes, built and wired (module docstring); closed on exit."""
    config = replace(config, trainer=trainer_config(config))
    with ExitStack() as stack:
        env = None
        if config.ray is None:  # episodes in this process: sandboxes must start here (probed first, before any work)
            env = open_environment()
            stack.callback(env.close)
        tasks_dir = task_set(config, status)
        curriculum, evals = split(config, tasks_dir)
        if set(evals) != set(config.run.held_out):
            config = replace(config, run=replace(config.run, held_out=tuple(evals), held_out_count=0))

        run = run_dir(config)
        stack.callback(run.close)
        try:
            loop = _wired_loop(config, run, tasks_dir, evals, curriculum, env, stack, status, argv)
        except BaseException as e:  # the loop records its own failures; these came before it started
            run.fail(e)
            raise
        yield loop


def train(config: RLConfig, *, argv: list[str] | None = None, status: Status = lambda _: None,
          on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Run the configured training to its last step (or resume it); the logged metrics lines."""
    import asyncio

    with open_run(config, status=status, argv=argv) as loop:
        loop.on_step = on_step
        return asyncio.run(loop.run_loop())
