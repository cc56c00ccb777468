"""`shipyard sft`: supervised fine-tuning on successful trajectories — the cold start before RL — on RL's code path.

RL sharpens what a policy already does sometimes: a group in which no rollout succeeds carries no task signal. A
small model that never reads the file, edits it and runs the tests never gets a reward to learn from. The recipe of
agent-RL work is a cold start first: fine-tune on trajectories that solved tasks, then RL (SWE-Gym, arXiv
2412.21139; SWE-smith, arXiv 2504.21798; Skywork-SWE, arXiv 2506.19290; Kimi-Dev, arXiv 2509.23045).

Nothing here is a second trainer. A demonstration is a `Rollout` whose `Trajectory` the harness produced in a
sandbox: the same wire format (chat template, tool schemas, tags) and the same token layout as an RL rollout, so it
becomes a `Batch` by `Batch.from_trajectories` and trains in the same `Trainer`, with `objective = "cross_entropy"`:

    L = − Σ_t m_t log π_θ(y_t) / Σ_t m_t        m_t = 1 on the policy's own tokens (each turn's completion)

— the prompt and the tool outputs are context, never targets. The run directory, config tree, checkpoints (resume
with `--run.resume true`) and Hugging Face export are a training run's, so `shipyard train` starts from the result
with `[model] name = "RUN/export"`.

Sources (`[sft] sources`), all from the run's **training** tasks:

- `"gold"`: each training task's gold patch replayed through the harness as a demonstration
  (`shipyard.rollout.gold`: read the file, `search_replace` the body, run the failing tests, summarise), run and graded
  in sandboxes like any eval; written to RUN/sft/gold.jsonl (reused on resume).
- a path: rollout records, one JSON object a line — `shipyard eval --rollouts FILE` (rejection sampling from any
  engine: the bundled 1.5B, a bigger model behind `openai:`), or a training run's RUN/trajectories/ directory (its
  own successes: expert iteration). The rollouts must be tokenized with the policy's tokenizer (eval's
  `--model.tokenizer`): a prompt that does not decode to its task's statement is refused.

A record is kept when the grader scored it 1.0, no reward-hacking monitor flagged it and it has sampled tokens; the
rest are counted by reason. A record of a held-out task — or of a task the set does not have — is an error, never
skipped: a held-out id anywhere in the data would make the held-out evaluation a measurement of memory.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from shipyard.errors import InputNotFound, UsageError, UserError
from shipyard.harness.tools import default_tools
from shipyard.harness.trajectory import Trajectory
from shipyard.harness.wire import ChatFormat
from shipyard.models.resolve import load_tokenizer
from shipyard.rl.build import run_dir, split, task_set
from shipyard.rl.config import RLConfig, save_config
from shipyard.rl.loop import export_policy
from shipyard.rl.ranks import RankSpec, trainer_ranks
from shipyard.rl.rundir import RunDir
from shipyard.rollout.episode import WireSettings
from shipyard.rollout.gold import GOLD_ENGINE, gold_engine
from shipyard.rollout.record import Rollout, read_rollout_lines
from shipyard.tasks.taskset import list_tasks, load_task
from shipyard.train.batch import Batch, turn_span
from shipyard.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from shipyard.train.trainer import Trainer

Status = Callable[[str], None]
SFT_STATE = "sft.json"
GOLD = "gold"
POOL_BATCHES = 8  # sft.group_by_length: batches sorted together (`batches`)


class HeldOutInData(UserError):
    """SFT data holds a rollout of a held-out task (or of a task outside the run's task set)."""


@dataclass
class Demonstrations:
    """The kept rollouts, and how many of each source were dropped and why."""

    rollouts: list[Rollout]
    dropped: dict[str, dict[str, int]]  # source → reason → count
    read: dict[str, int]  # source → records read

    def summary(self, max_new_tokens: int) -> dict[str, Any]:
        """Counts for RUN/sft/data.json; `over_max_new_tokens`: demonstrations with a target turn (no failed call:
        `demonstration_batch`) longer than the episodes' `max_new_tokens`, which the policy learns to write and its
        episodes then cut."""
        tasks = Counter(r.task_id for r in self.rollouts)
        longest = [max((len(t.completion_ids) for t in r.trajectory.turns if not t.failed_calls), default=0)
                   for r in self.rollouts]
        return {"demonstrations": len(self.rollouts), "tasks": len(tasks), "read": self.read, "dropped": self.dropped,
                "tokens": sum(r.trajectory.sampled_tokens for r in self.rollouts if r.trajectory),
                "longest_turn": max(longest, default=0),
                "over_max_new_tokens": sum(n > max_new_tokens for n in longest)}


def read_rollouts(path: Path) -> list[Rollout]:
    """Rollout records from a JSON-lines file, or from every `*.jsonl` file of a directory (a run's trajectories/).
    Keys a run adds beside the record (`hints`) are ignored; a line that is not a record is an error naming it."""
    path = Path(path)
    if not path.exists():
        raise InputNotFound(f"SFT source {path} does not exist: give `gold`, a rollouts file (`shipyard eval "
                            f"--rollouts FILE`) or a run's trajectories/ directory")
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    return [rollout for file in files for rollout in read_rollout_lines(file)]


def why_dropped(rollout: Rollout) -> str | None:
    """Why a rollout is no demonstration (None: it is one). A gold replay (its trajectory's model is the
    `replay:gold` engine, in RUN/sft/gold.jsonl or in any eval's rollouts file) writes the deleted code back by
    definition, so the `verbatim` monitor's flag (the patch restores the deleted lines word for word) is expected of it
    and does not drop it; any other flag does."""
    if rollout.trajectory is None or not rollout.trajectory.turns:
        return "no_trajectory"
    if rollout.reward != 1.0:
        return "not_solved"
    gold = rollout.trajectory.model == GOLD_ENGINE
    if any(not (gold and f.get("kind") == "verbatim") for f in rollout.monitor_flags):
        return "flagged"
    if rollout.trajectory.sampled_tokens == 0:
        return "no_tokens"
    return None


def select(sources: dict[str, list[Rollout]], train_ids: set[str], held: set[str], tasks_dir: Path,
           chat: ChatFormat) -> Demonstrations:
    """The demonstrations among `sources` (name → records): see the module docstring. Raises `HeldOutInData` for a
    record of a held-out task or of no task of the set, `UserError` for one tokenized for another model."""
    kept, dropped, read = [], {}, {}
    statements: dict[str, str] = {}
    header: tuple[int, ...] = ()
    for name, rollouts in sources.items():
        reasons: Counter[str] = Counter()
        for r in rollouts:
            if r.task_id in held:
                raise HeldOutInData(f"SFT source {name}: rollout {r.rollout_id} is of held-out task {r.task_id}; the "
                                    f"held-out tasks are never trained on: drop its records, or change run.held_out")
            if r.task_id not in train_ids:
                raise HeldOutInData(f"SFT source {name}: rollout {r.rollout_id} is of task {r.task_id}, which the "
                                    f"task set {tasks_dir} does not have: was it sampled from another task set?")
            reason = why_dropped(r)
            if reason is not None:
                reasons[reason] += 1
                continue
            if r.task_id not in statements:
                statements[r.task_id] = load_task(tasks_dir, r.task_id)[0].statement
            header = header or tuple(chat.assistant_header_ids())  # rendered once, when a record is first kept
            _check_rendering(name, r, statements[r.task_id], chat, header)
            kept.append(r)
        dropped[name], read[name] = dict(reasons), len(rollouts)
    return Demonstrations(kept, dropped, read)


def _check_rendering(source: str, rollout: Rollout, statement: str, chat: ChatFormat,
                     header: tuple[int, ...]) -> None:
    """The trajectory was tokenized with the policy's tokenizer and chat format: its ids are in the vocabulary, its
    prompt ends with the policy's assistant header and decodes to text that holds the task's statement."""
    traj = rollout.trajectory
    if written_with_tag_tokens(rollout, chat):
        raise UserError(f"SFT source {source}: rollout {rollout.rollout_id} writes the call tags as control tokens, "
                        f"while this run's wire spells them (episode.loop.tags = \"spelled\"): the policy would learn "
                        f"a token it cannot write. Sample it with the same tags (`shipyard eval --episode.loop.tags "
                        f"spelled`)")
    vocab = len(chat.tokenizer)
    ids = traj.token_ids()
    bad = max(ids, default=0) >= vocab or tuple(traj.prompt_ids[-len(header):]) != header or \
        statement.strip()[:200] not in chat.tokenizer.decode(traj.prompt_ids)
    if bad:
        raise UserError(f"SFT source {source}: rollout {rollout.rollout_id} was not rendered with this policy's "
                        f"tokenizer and chat format (model {traj.model!r}); sample it with the policy's tokenizer "
                        f"(`shipyard eval --model.tokenizer MODEL`) and the same episode settings (`--config "
                        f"RUN.toml`)")


def written_with_tag_tokens(rollout: Rollout, chat: ChatFormat) -> bool:
    """Whether a completion of the rollout holds a call tag's control token while the run spells the tags: a
    demonstration the policy could not reproduce (the bundled Qwen models' tag token is untrained: docs/harness.md)."""
    tags = chat.tag_ids() if chat.tags == "spelled" else set()
    turns = rollout.trajectory.turns if rollout.trajectory is not None else []
    return bool(tags) and any(not tags.isdisjoint(t.completion_ids) for t in turns)


def gold_rollouts(config: RLConfig, tasks_dir: Path, task_ids: list[str], chat: ChatFormat, out: Path,
                  status: Status) -> list[Rollout]:
    """Replay the gold demonstration of every task in `task_ids` through the harness in sandboxes (an eval with the
    `replay:gold` engine), its records in `out`, an eval journal (`OUT.partial` while it is written, so a stopped
    run's finished replays are kept). Each message is encoded as the policy writes it under the run's wire
    (`ChatFormat.completion_ids`). An existing `out` (a resumed run) is read back: replays an infrastructure failure
    left without a grade are made again (the journal resumed), and when the saved replays are not what this run would
    replay (`stale_replays`), all of them are."""
    from shipyard.rollout.environment import LocalEnvironment
    from shipyard.rollout.evalrun import EvalConfig, run_eval, settings_path

    engine = gold_engine(tasks_dir, task_ids, tokenizer=chat.tokenizer, encode=chat.completion_ids)
    partial = out.with_name(out.name + ".partial")  # the replays' journal: a stopped run's finished ones are kept
    if out.exists():
        replays = _last_replays(read_rollouts(out), task_ids)
        why = stale_replays(replays, task_ids, engine.scripts, chat)
        lost = sum(r.masked for r in replays)
        if why is None and not lost:
            return replays
        if why is None:
            status(f"{out}: {lost} replay(s) ended without a grade (an infrastructure failure): replaying those")
            out.rename(partial)
            if settings_path(out).exists():  # without it (an older shipyard's), the resume replays all
                settings_path(out).rename(settings_path(partial))
        else:
            status(f"{out}: {why}; replaying again")
            out.unlink()
            settings_path(out).unlink(missing_ok=True)
    loop = config.episode.loop
    turns = max((len(s) for s in engine.scripts.values()), default=1)  # a replay is played whole: its turns fit
    episode = replace(config.episode, loop=replace(loop, max_new_tokens=max(loop.max_new_tokens, engine.longest() + 8),
                                                   max_turns=max(loop.max_turns, turns)))
    eval_config = EvalConfig(samples=1, seed=config.run.seed, concurrency=max(1, config.rollout.max_in_flight or 2))
    env = LocalEnvironment()

    def replay(resume: bool) -> list[Rollout]:
        try:
            run_eval(engine, env, tasks_dir, task_ids, episode, eval_config, rollouts_path=partial, resume=resume)
        except UsageError:  # replayed with other settings (or before journals had them): replay all again
            partial.unlink(missing_ok=True)
            run_eval(engine, env, tasks_dir, task_ids, episode, eval_config, rollouts_path=partial)
        return _last_replays(read_rollouts(partial), task_ids)

    status(f"replaying {len(task_ids)} gold demonstrations in sandboxes")
    try:
        replays = replay(resume=True)
        why = stale_replays(replays, task_ids, engine.scripts, chat)
        if why is not None:  # the journal a stopped run left was of other demonstrations
            status(f"{partial}: {why}; replaying again")
            partial.unlink()
            replays = replay(resume=False)
    finally:
        env.close()
        engine.close()
    partial.rename(out)
    settings_path(partial).rename(settings_path(out))  # kept: a later resume replays what infrastructure lost
    return replays


def stale_replays(replays: list[Rollout], task_ids: list[str], scripts: dict[str, list[str]],
                  chat: ChatFormat) -> str | None:
    """Why saved gold replays are not the ones this run would make for `task_ids` (None: they are): a task without
    one; call tags written as control tokens under spelled tags (an older shipyard did); or turns that are not the
    task's script as this run encodes it (`_replays_script`: a newer shipyard's demonstrations, a re-synthesized task,
    another wire)."""
    have = {r.task_id for r in replays}
    missing = [t for t in task_ids if t not in have]
    if missing:
        return f"no replay of {len(missing)} training task(s), e.g. {missing[0]}"
    tagged = [r.task_id for r in replays if written_with_tag_tokens(r, chat)]
    if tagged:
        return f"{len(tagged)} replay(s) hold the call tags as control tokens, which this run spells"
    other = [r.task_id for r in replays if not _replays_script(r, scripts[r.task_id], chat)]
    if other:
        return (f"{len(other)} replay(s) differ from the demonstration this shipyard writes for their task "
                f"(e.g. {other[0]}: the demonstrations changed, or the task was made again)")
    return None


def _replays_script(replay: Rollout, script: list[str], chat: ChatFormat) -> bool:
    """Whether the replay's turns are the script's messages, token for token as the run's wire writes them
    (`ChatFormat.completion_ids`, then the stop token the replay engine ends a whole message with). Only where the
    episode stopped it early may it differ: its last turn cut at its token budget (`finish_reason` "length": a prefix
    of its message), or fewer turns than the script when it did not end on a final answer (its calls failed, its
    context ran out). A replay without a grade (an infrastructure failure) has nothing to compare: it is made again."""
    if replay.masked:
        return True
    turns = replay.trajectory.turns if replay.trajectory is not None else []
    if len(turns) > len(script):
        return False
    stops = set(chat.stop_token_ids)
    for i, (turn, message) in enumerate(zip(turns, script, strict=False)):
        ids, got = chat.completion_ids(message), turn.completion_ids
        whole = got == ids or (len(got) == len(ids) + 1 and got[:-1] == ids and got[-1] in stops)
        cut = i == len(turns) - 1 and turn.finish_reason == "length" and ids[:len(got)] == got
        if not (whole or cut):
            return False
    return len(turns) == len(script) or replay.stop_reason != "finished"


def _last_replays(rollouts: list[Rollout], task_ids: list[str]) -> list[Rollout]:
    """The last replay of each of `task_ids` (a resumed journal holds a masked replay and, after it, its rerun)."""
    wanted = set(task_ids)
    return list({r.task_id: r for r in rollouts if r.task_id in wanted}.values())


def batches(n: int, batch_size: int, epochs: int, seed: int, lengths: Sequence[int] | None = None
            ) -> Iterator[tuple[int, list[int]]]:
    """(epoch, indices) of each step: every epoch a fresh permutation (seeded by `seed` and the epoch, so a resumed
    run replays the same order), cut into batches of `batch_size` (one of an epoch's may be smaller: the last, or with
    `lengths` the last of a pool).

    With `lengths` (`sft.group_by_length`), batches of similar length: the permutation is cut into pools of
    `POOL_BATCHES` batches, each pool sorted by length and cut into batches, and the epoch's batches shuffled again
    (a pool keeps the batches random in content; sorting the whole epoch would give the same batches every epoch).
    The trainer computes a micro-batch's shared prefix once and pads each row's own tokens to its longest
    (`shipyard.train.prefix`), so a batch costs about prefix + rows × longest suffix: on the learning pool's 79 gold
    demonstrations (1,560 shared tokens, 2.5k-5.3k long) 11.7k positions a batch of 4 instead of 15.1k."""
    if lengths is not None and len(lengths) != n:
        raise ValueError(f"{len(lengths)} lengths for {n} demonstrations")
    for epoch in range(epochs):
        order = list(range(n))
        rng = random.Random(f"{seed}:{epoch}")
        rng.shuffle(order)
        if lengths is None:
            cut = [order[i:i + batch_size] for i in range(0, n, batch_size)]
        else:
            pool = batch_size * POOL_BATCHES
            cut = []
            for start in range(0, n, pool):
                ranked = sorted(order[start:start + pool], key=lambda i: -lengths[i])
                cut += [ranked[i:i + batch_size] for i in range(0, len(ranked), batch_size)]
            rng.shuffle(cut)
        for picked in cut:
            yield epoch, picked


def sft(config: RLConfig, *, argv: list[str] | None = None, status: Status = lambda _: None,
        on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Fine-tune `config.model` on the demonstrations of `config.sft` (module docstring); the logged lines."""
    started = time.monotonic()
    optim = config.trainer.optim if config.sft.lr is None else replace(config.trainer.optim, lr=config.sft.lr)
    config = replace(config, trainer=replace(config.trainer, objective="cross_entropy", optim=optim,
                                             distill=replace(config.trainer.distill, enabled=False)))
    tasks_dir = task_set(config, status)
    _, evals = split(config, tasks_dir)
    held = set(evals)
    train_ids = [t for t in list_tasks(tasks_dir) if t not in held]
    if set(evals) != set(config.run.held_out):  # the split, recorded in RUN/config.toml (as `shipyard train` does)
        config = replace(config, run=replace(config.run, held_out=tuple(evals), held_out_count=0))
    run = run_dir(config)
    deadline = None if config.run.max_minutes is None else started + 60 * config.run.max_minutes
    try:
        return _run(config, run, tasks_dir, train_ids, held, argv, status, on_step, deadline)
    except BaseException as e:
        run.fail(e)
        raise
    finally:
        run.close()


def _run(config: RLConfig, run: RunDir, tasks_dir: Path, train_ids: list[str], held: set[str],
         argv: list[str] | None, status: Status, on_step: Callable[[int, dict], None] | None,
         deadline: float | None) -> list[dict]:
    save_config(config, run.config_path, note="shipyard sft " + " ".join(argv or []))
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.name, status)
    loop = config.episode.loop
    chat = ChatFormat(tokenizer, default_tools(), tags=loop.tags)
    sources: dict[str, list[Rollout]] = {}
    for source in config.sft.sources:
        if source == GOLD:
            sources[GOLD] = gold_rollouts(config, tasks_dir, train_ids, chat, run.root / "sft" / "gold.jsonl", status)
        else:
            sources[source] = read_rollouts(Path(source))
    data = select(sources, set(train_ids), held, tasks_dir, chat)
    (run.root / "sft").mkdir(exist_ok=True)
    summary = data.summary(loop.max_new_tokens)
    (run.root / "sft" / "data.json").write_text(json.dumps(summary, indent=1) + "\n")
    status(f"{summary['demonstrations']} demonstrations of {summary['tasks']} tasks ({data.dropped} dropped)")
    if summary["over_max_new_tokens"]:
        status(f"warning: {summary['over_max_new_tokens']} demonstrations have a turn longer than "
               f"episode.loop.max_new_tokens = {loop.max_new_tokens} (the longest: {summary['longest_turn']} tokens); "
               f"the policy learns to write turns its episodes cut. Raise it to at least {summary['longest_turn']}")
    if not data.rollouts:
        raise UserError(f"no demonstration to train on (read {data.read}, dropped {data.dropped}): a demonstration is "
                        f"a rollout of a training task scored 1.0 and not flagged")
    sft_cfg = config.sft
    total = sft_cfg.epochs * math.ceil(len(data.rollouts) / sft_cfg.batch_size)
    with ExitStack() as stack:
        header = chat.assistant_header_ids()
        spec = RankSpec.of(config, tokenizer.pad_token_id, header)
        group = stack.enter_context(trainer_ranks(spec, status))
        trainer = Trainer(group.model, spec.trainer, pad_id=tokenizer.pad_token_id, header_ids=header,
                          device=group.device)
        ranks = group.ranks(trainer)
        plan = {"sft.batch_size": sft_cfg.batch_size, "sft.group_by_length": sft_cfg.group_by_length,
                "run.seed": config.run.seed}
        checkpoint = latest_checkpoint(run.checkpoints_dir)
        if checkpoint is not None:
            same_plan(checkpoint / SFT_STATE, plan)
            ranks(load_checkpoint, checkpoint)
        wire = WireSettings(loop.untagged_calls, loop.tags)
        lines: list[dict] = []
        longest, stopped = 0.0, None
        lengths = [len(r.trajectory.token_ids()) for r in data.rollouts] if sft_cfg.group_by_length else None
        steps = batches(len(data.rollouts), sft_cfg.batch_size, sft_cfg.epochs, config.run.seed, lengths)
        for step, (epoch, picked) in enumerate(steps, 1):
            if step <= trainer.step_count:  # done before the checkpoint this run resumed from
                continue
            begun = time.monotonic()
            chunk = [data.rollouts[i] for i in picked]
            batch, masked = demonstration_batch([r.trajectory for r in chunk], trainer.pad_id)
            train = ranks(Trainer.step, batch)
            lines.append(run.log(step, {"train": train, "sft": {"epoch": epoch, "demonstrations": len(chunk),
                                                                "tasks": len({r.task_id for r in chunk}),
                                                                "masked_turns": masked}}))
            longest = max(longest, time.monotonic() - begun)
            # run.max_minutes: no step is started that would not end within the budget (as `shipyard train`)
            if deadline is not None and step < total and time.monotonic() + longest > deadline:
                stopped = "max_minutes"
            last = step == total or stopped is not None
            if step % config.run.checkpoint_every == 0 or last:
                state = json.dumps({"step": step, "total": total, **plan})
                ranks(save_checkpoint, run.checkpoints_dir, extra={SFT_STATE: state}, keep=config.run.keep_checkpoints)
                if config.run.export or last:
                    export_policy(trainer, ranks(Trainer.export_weights), tokenizer, run.export_dir, wire)
            run.set_status("running", step=step, steps=total)
            if on_step is not None:
                on_step(step, lines[-1])
            if stopped is not None:
                break
        done = trainer.step_count
        if exported_step(run.export_dir) != done:  # a run that died while exporting, resumed with no step left
            export_policy(trainer, ranks(Trainer.export_weights), tokenizer, run.export_dir, wire)
    run.set_status("finished", step=done, steps=total, export=str(run.export_dir), stopped=stopped)
    return lines


def same_plan(state: Path, plan: dict) -> None:
    """Refuse to resume a run whose checkpoint (`state`: its sft.json) was trained on another order of batches: the
    plan from the resumed step on would repeat some demonstrations and skip others. A checkpoint from before the plan
    was recorded resumes as it always did."""
    try:
        saved = json.loads(state.read_text())
    except (OSError, ValueError):
        return
    for name, value in plan.items():  # keyed by the settings' names
        if name in saved and saved[name] != value:
            raise UsageError(f"{state.parent} was trained with {name} = {json.dumps(saved[name])}; resuming with "
                             f"{json.dumps(value)} would train on another order of demonstrations (some twice, some "
                             f"never): resume with {name} = {json.dumps(saved[name])}, or train in a new run.dir")


def exported_step(directory: Path) -> int | None:
    """The trainer step an export holds (its shipyard.json), None when there is no complete export."""
    try:
        return json.loads((directory / "shipyard.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def demonstration_batch(trajectories: list[Trajectory], pad_id: int) -> tuple[Batch, int]:
    """The trainer batch of demonstrations, and how many turns were masked: a turn with a call that failed (malformed,
    unknown tool, bad arguments, a tool error…) is context, not a target — a success can contain mistakes the model
    recovered from, and imitating the mistake is not the lesson. The turns after it still train (the recovery is)."""
    batch = Batch.from_trajectories(trajectories, [1.0] * len(trajectories), pad_id=pad_id)
    failed = [(b, i) for b, traj in enumerate(trajectories) for i, turn in enumerate(traj.turns) if turn.failed_calls]
    for b, i in failed:
        start, end = turn_span(trajectories[b], i)
        batch.loss_mask[b, start:end] = 0
    return batch, len(failed)
