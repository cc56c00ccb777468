"""`shipyard sft`: demonstrations from gold replays and rollout files, trained with the RL trainer's cross-entropy
objective into a run directory whose export `shipyard train` starts from; a held-out task in the data is refused."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from servers import needs_sandbox
from tiny_run import CONFIG

from shipyard.errors import UserError
from shipyard.harness.tools import default_tools
from shipyard.harness.trajectory import Trajectory, Turn
from shipyard.harness.wire import ChatFormat
from shipyard.rl.config import SFTConfig, load_config
from shipyard.rollout.record import Rollout


def _rollout(task: str, reward: float | None = 1.0, flags: list | None = None, turns: int = 1) -> Rollout:
    traj = Trajectory(task=task, model="m", prompt_ids=[1, 2],
                      turns=[Turn(index=i, text="x", completion_ids=[3, 4], logprobs=[0.0, 0.0], finish_reason="stop",
                                  observation_ids=[5], calls=[], parallel_width=0, generate_seconds=0.0,
                                  tools_seconds=0.0) for i in range(turns)])
    return Rollout(task_id=task, group_id=f"{task}@eval", index=0, seed=0, status="passed" if reward else "failed",
                   reward=reward, trajectory=traj, monitor_flags=flags or [])


def _write(path: Path, rollouts: list[Rollout], extra: str = "") -> Path:
    path.write_text("".join(json.dumps({**r.to_json(), "hints": []}) + "\n" for r in rollouts) + extra)
    return path


def test_why_dropped_keeps_only_clean_solved_trajectories():
    from shipyard.rl.sft import why_dropped

    assert why_dropped(_rollout("a")) is None
    assert why_dropped(_rollout("a", reward=0.0)) == "not_solved"
    assert why_dropped(_rollout("a", reward=None)) == "not_solved"  # masked: unknown is never a success
    assert why_dropped(_rollout("a", flags=[{"kind": "test_fitting"}])) == "flagged"
    verbatim = _rollout("a", flags=[{"kind": "verbatim"}])  # what a gold replay is by definition
    assert why_dropped(verbatim) == "flagged"
    verbatim.trajectory.model = "replay:gold"
    assert why_dropped(verbatim) is None
    verbatim.monitor_flags.append({"kind": "tamper"})
    assert why_dropped(verbatim) == "flagged"
    assert why_dropped(_rollout("a", turns=0)) == "no_trajectory"
    assert why_dropped(replace(_rollout("a"), trajectory=None)) == "no_trajectory"


def test_the_data_summary_counts_demonstrations_whose_target_turns_the_episodes_would_cut():
    """A target turn longer than the episodes' max_new_tokens is one the policy learns to write and its episodes then
    cut (2026-12-07: 32 of 120 gold demonstrations over 384); a turn whose call failed is context, never counted."""
    from shipyard.harness.trajectory import CallRecord
    from shipyard.rl.sft import Demonstrations

    long, failed = _rollout("a", turns=2), _rollout("b", turns=2)
    long.trajectory.turns[1].completion_ids = list(range(10))
    failed.trajectory.turns[1].completion_ids = list(range(10))
    failed.trajectory.turns[1].calls = [CallRecord(0, "read_file", {"path": "x"}, "", "no such file", 0.0)]
    summary = Demonstrations([long, failed], {}, {}).summary(max_new_tokens=5)
    assert (summary["over_max_new_tokens"], summary["longest_turn"]) == (1, 10)
    assert Demonstrations([long], {}, {}).summary(max_new_tokens=10)["over_max_new_tokens"] == 0


def test_read_rollouts_reads_eval_files_and_run_directories_and_names_a_bad_line(tmp_path):
    from shipyard.errors import FileFormatError, InputNotFound
    from shipyard.rl.sft import read_rollouts

    one = _write(tmp_path / "eval.jsonl", [_rollout("a"), _rollout("b", reward=0.0)])
    assert [r.task_id for r in read_rollouts(one)] == ["a", "b"]
    run = tmp_path / "trajectories"
    run.mkdir()
    _write(run / "step-000001.jsonl", [_rollout("a")])
    _write(run / "step-000002.jsonl", [_rollout("c")])
    assert [r.task_id for r in read_rollouts(run)] == ["a", "c"]
    bad = _write(tmp_path / "bad.jsonl", [_rollout("a")], extra='{"task_id": "x"}\n')
    with pytest.raises(FileFormatError, match=r"bad.jsonl:2: not a rollout record"):
        read_rollouts(bad)
    with pytest.raises(FileFormatError, match=r"bad2.jsonl:1"):
        read_rollouts(_write(tmp_path / "bad2.jsonl", [], extra="[1, 2]\n"))
    with pytest.raises(InputNotFound, match="does not exist"):
        read_rollouts(tmp_path / "missing.jsonl")


def test_a_held_out_or_unknown_task_in_the_data_is_refused(tmp_path):
    from shipyard.rl.sft import HeldOutInData, select

    with pytest.raises(HeldOutInData, match="held-out task h"):
        select({"f.jsonl": [_rollout("a", reward=0.0), _rollout("h", reward=0.0)]}, {"a"}, {"h"}, tmp_path, None)
    with pytest.raises(HeldOutInData, match="task z, which the task set"):
        select({"f.jsonl": [_rollout("z", reward=0.0)]}, {"a"}, {"h"}, tmp_path, None)
    # dropped records are counted by reason (nothing here is kept, so nothing is rendered)
    records = [_rollout("a", reward=0.0), _rollout("a", flags=[{"kind": "verbatim"}])]
    data = select({"f.jsonl": records}, {"a"}, set(), tmp_path, None)
    assert data.rollouts == [] and data.dropped == {"f.jsonl": {"not_solved": 1, "flagged": 1}}


def test_batches_visit_every_demonstration_once_an_epoch_in_a_seeded_order():
    from shipyard.rl.sft import batches

    plan = list(batches(5, 2, 3, seed=7))
    assert [len(b) for _, b in plan] == [2, 2, 1] * 3 and [e for e, _ in plan] == [0] * 3 + [1] * 3 + [2] * 3
    for epoch in range(3):
        assert sorted(i for e, b in plan if e == epoch for i in b) == list(range(5))
    assert plan == list(batches(5, 2, 3, seed=7)) and plan != list(batches(5, 2, 3, seed=8))
    from shipyard.rl.sft import POOL_BATCHES

    # by length: the same demonstrations each epoch, in batches of neighbours in length within each pool, seeded
    lengths = [(i * 37) % 101 for i in range(70)]
    grouped = list(batches(70, 4, 2, seed=7, lengths=lengths))
    assert grouped == list(batches(70, 4, 2, seed=7, lengths=lengths))
    for epoch in range(2):
        assert sorted(i for e, b in grouped if e == epoch for i in b) == list(range(70))
    pool = 4 * POOL_BATCHES
    for epoch in range(2):
        order = list(range(70))
        random.Random(f"7:{epoch}").shuffle(order)
        pools = [set(order[i:i + pool]) for i in range(0, 70, pool)]
        for _, b in (x for x in grouped if x[0] == epoch):
            home = next(p for p in pools if b[0] in p)
            assert set(b) <= home  # a batch never mixes pools
            ranked = sorted(home, key=lambda i: -lengths[i])
            start = ranked.index(b[0])
            assert b == ranked[start:start + len(b)]  # and holds length neighbours
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for _, b in grouped)
    assert spread < sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for _, b in batches(70, 4, 2, 7)) / 3
    with pytest.raises(ValueError, match="2 lengths for 3"):
        list(batches(3, 2, 1, 0, lengths=[1, 2]))
    with pytest.raises(ValueError, match="at least 1"):
        SFTConfig(epochs=0)
    with pytest.raises(ValueError, match="empty"):
        SFTConfig(sources=())


SFT = """
[sft]
sources = ["gold"]
epochs = 3
batch_size = 2
"""


def test_a_resume_under_another_order_of_batches_is_refused(tmp_path):
    """The checkpoint records the plan its steps followed; resuming under another would repeat some demonstrations
    and skip others. A checkpoint from before plans were recorded resumes as it did."""
    from shipyard.errors import UsageError
    from shipyard.rl.sft import same_plan

    plan = {"sft.batch_size": 4, "sft.group_by_length": True, "run.seed": 0}
    state = tmp_path / "sft.json"
    same_plan(state, plan)  # no state file
    state.write_text(json.dumps({"step": 2, "total": 20}))
    same_plan(state, plan)
    state.write_text(json.dumps({"step": 2, "total": 20, **plan}))
    same_plan(state, plan)
    with pytest.raises(UsageError, match="sft.group_by_length = true; resuming with false"):
        same_plan(state, {**plan, "sft.group_by_length": False})
    with pytest.raises(UsageError, match="run.seed = 0"):
        same_plan(state, {**plan, "run.seed": 1})

@needs_sandbox
def test_sft_on_gold_replays_trains_the_policy_tokens_and_exports(taskset, tmp_path):
    from safetensors.torch import load_file

    from shipyard.rl.sft import sft

    config_path = _config_file(tmp_path, taskset[0])
    config = load_config(config_path, ["--run.dir", str(tmp_path / "run")])
    lines = sft(config)
    run = tmp_path / "run"
    # the journal renamed, its settings kept beside it (a resume makes again what infrastructure lost)
    assert sorted(p.name for p in (run / "sft").iterdir() if "gold" in p.name) == ["gold.jsonl",
                                                                                    "gold.jsonl.settings.json"]
    data = json.loads((run / "sft" / "data.json").read_text())
    held = load_config(run / "config.toml").run.held_out
    assert len(held) == 1
    # every training task's gold replay ran in a sandbox, scored 1.0 and became a demonstration
    gold = [json.loads(x) for x in (run / "sft" / "gold.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in gold) == sorted(set(json.loads(x)["id"] for x in
                                                         (taskset[0] / "tasks.jsonl").read_text().splitlines())
                                                        - set(held))
    assert all(r["reward"] == 1.0 for r in gold) and data["demonstrations"] == len(gold) == 2
    assert data["over_max_new_tokens"] == 2 < data["longest_turn"]  # the tiny episodes' turns are 12 tokens: warned
    assert [line["step"] for line in lines] == [1, 2, 3]  # 3 epochs of one batch of 2
    losses = [line["train/sft_loss"] for line in lines]
    assert losses[-1] < losses[0]  # the same demonstrations, three times: their NLL falls
    assert all(line["train/tokens"] == lines[0]["train/tokens"] > 0 for line in lines)
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    exported = load_file(run / "export" / "model.safetensors")
    assert exported and (run / "export" / "shipyard.json").exists()
    # one a step, the newest two kept (run.keep_checkpoints)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    # The demonstrations as a rollouts file (what a rejection-sampling eval writes), sft.lr over trainer.optim.lr,
    # batches by length, and a wall-time budget: the step that reaches it is the last, then a checkpoint and the export.
    again = load_config(config_path, ["--run.dir", str(tmp_path / "again"), "--sft.sources",
                                      str(run / "sft" / "gold.jsonl"), "--sft.lr", "3e-4", "--run.max_minutes", "1e-4",
                                      "--sft.group_by_length", "true"])
    cut = sft(again)
    status = json.loads((tmp_path / "again" / "run.json").read_text())
    assert [line["step"] for line in cut] == [1] and cut[0]["train/lr"] == pytest.approx(3e-4)
    assert status["status"] == "finished" and status["stopped"] == "max_minutes" and status["steps"] == 3
    assert (tmp_path / "again" / "export" / "model.safetensors").exists()


@needs_sandbox
def test_the_sft_command_refuses_a_held_out_task_in_its_data(taskset, tmp_path):
    config_path = tmp_path / "tiny.toml"
    config_path.write_text(CONFIG.format(tasks=taskset[0]))
    ids = [json.loads(x)["id"] for x in (taskset[0] / "tasks.jsonl").read_text().splitlines()]
    data = _write(tmp_path / "eval.jsonl", [_rollout(ids[0])])
    proc = subprocess.run([sys.executable, "-m", "shipyard.cli", "sft", str(config_path), "--run.dir",
                           str(tmp_path / "run"), "--run.held_out_count", "0", "--run.held_out", ids[0],
                           "--sft.sources", str(data)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"held-out task {ids[0]}" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"


def test_a_turn_whose_call_failed_is_context_not_a_target(tmp_path):
    from shipyard.harness.trajectory import CallRecord
    from shipyard.rl.sft import demonstration_batch, exported_step

    traj = _rollout("a", turns=3).trajectory
    traj.turns[1].calls = [CallRecord(index=0, name="read_file", arguments={}, output="", error="missing path",
                                      seconds=0.0, error_kind="bad_arguments")]
    batch, masked = demonstration_batch([traj], pad_id=0)
    # prompt [1, 2], then per turn completion [3, 4] and observation [5]: turn 1's completion is positions 5-6
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0] and masked == 1
    assert exported_step(tmp_path) is None
    (tmp_path / "shipyard.json").write_text('{"step": 4}')
    assert exported_step(tmp_path) == 4


def test_saved_gold_replays_are_this_runs_only_while_each_turn_is_its_scripts_message_as_the_wire_writes_it():
    """What a resumed run checks before it trains on saved replays (`stale_replays`): token for token, each turn is
    its script's message as this run's wire encodes it, then the stop token. Only an episode that stopped the replay
    early may leave it shorter: a last turn cut at its budget (finish "length"), or fewer turns when it did not end on
    a final answer. A replay of another script (a newer shipyard's demonstrations, 2026-12-07), of another wire, or
    with the tag tokens under spelled tags is stale, and so is a training task without one."""
    from shipyard.rl.sft import stale_replays

    spelled, token = _chat("spelled"), _chat("token")
    call = 'Reading it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
    script = [call, 'Editing: END = "<|endoftext|>" goes back.\n', "Done: `f` is written."]  # a special token's text
    scripts = {"a": script}
    stop = spelled.stop_token_ids[-1]

    def saved(ids: list[list[int]], finish: str = "stop", stopped: str = "finished") -> Rollout:
        rollout = _rollout("a", turns=len(ids))
        rollout.stop_reason = stopped
        for turn, got in zip(rollout.trajectory.turns, ids, strict=True):
            turn.completion_ids, turn.finish_reason = got, "stop"
        if ids:
            rollout.trajectory.turns[-1].finish_reason = finish
        return rollout

    def whole(chat, messages: list[str]) -> list[list[int]]:
        return [chat.completion_ids(m) + [stop] for m in messages]

    def stale(rollout: Rollout, chat=spelled) -> str | None:
        return stale_replays([rollout], ["a"], scripts, chat)

    assert stale(saved(whole(spelled, script))) is None
    cut = whole(spelled, script[:2]) + [spelled.completion_ids(script[2])[:3]]
    assert stale(saved(cut, finish="length")) is None  # its budget ran out mid-message
    assert stale(saved(cut)) is not None  # a shorter message that was not cut: another script's
    assert stale(saved(whole(spelled, [*script[:2], "Done."]))) is not None  # an older script's last message
    assert stale(saved(whole(spelled, script[:2]), stopped="repeated_failures")) is None  # the episode ended it
    assert stale(saved(whole(spelled, script[:2]))) is not None  # "finished" early: its script had fewer turns
    assert stale(saved(whole(spelled, [*script, "More."]))) is not None
    lost = saved([])
    lost.reward = None
    assert stale(lost) is None  # an infrastructure failure: nothing to compare, and the resume makes it again
    assert "differ from the demonstration" in stale(saved(whole(spelled, script)), chat=token)  # another wire
    tagged = saved(whole(token, script))
    assert "call tags as control tokens" in stale(tagged)
    assert stale_replays([], ["a"], scripts, spelled) == "no replay of 1 training task(s), e.g. a"


@needs_sandbox
def test_a_resumed_run_replays_only_what_infrastructure_lost_or_everything_when_the_demonstrations_changed(
        taskset, tmp_path):
    """Saved replays are an eval journal: on a resume, the replays an infrastructure failure left without a grade are
    made again and the others kept; the last replay of each training task is used, and replays of tasks no longer
    trained on (another split) are left out rather than refused as held-out data. When the demonstrations changed,
    every task is replayed."""
    from shipyard.models.resolve import load_tokenizer
    from shipyard.rl.sft import gold_rollouts, stale_replays
    from shipyard.rollout.gold import gold_scripts
    from shipyard.rollout.record import read_rollout_lines
    from shipyard.tasks.taskset import list_tasks

    tasks_dir = taskset[0]
    config = load_config(_config_file(tmp_path, tasks_dir))
    chat = ChatFormat(load_tokenizer(config.model.name), default_tools(), tags=config.episode.loop.tags)
    a, b = list_tasks(tasks_dir)[:2]
    scripts = gold_scripts(tasks_dir, [a, b], chat.tokenizer)
    out, messages = tmp_path / "gold.jsonl", []
    first = gold_rollouts(config, tasks_dir, [a, b], chat, out, messages.append)
    assert sorted((r.task_id, r.reward) for r in first) == [(a, 1.0), (b, 1.0)]
    assert stale_replays(first, [a, b], scripts, chat) is None

    records = read_rollout_lines(out)
    for r in records:
        r.worker = "kept"  # what a replay made again would not have
    of_a = next(r for r in records if r.task_id == a)
    lost = replace(of_a, reward=None, status="infra_error", trajectory=None, worker="lost")
    other = replace(of_a, task_id="held-out-now", group_id="held-out-now@eval", worker="other")
    _write(out, [*(r for r in records if r.task_id != a), lost, other])  # a's replay lost to its sandbox
    got = gold_rollouts(config, tasks_dir, [a, b], chat, out, messages.append)
    assert "1 replay(s) ended without a grade" in messages[-2]  # then "replaying 2 gold demonstrations"
    assert sorted((r.task_id, r.reward, r.worker == "kept") for r in got) == [(a, 1.0, False), (b, 1.0, True)]

    last = of_a.trajectory.turns[-1]  # an older script's last message, say
    last.completion_ids = chat.completion_ids("Done.")
    last.logprobs = [0.0] * len(last.completion_ids)
    _write(out, [of_a, next(r for r in records if r.task_id == b)])
    got = gold_rollouts(config, tasks_dir, [a, b], chat, out, messages.append)
    assert "1 replay(s) differ from the demonstration this shipyard writes" in messages[-2]
    assert sorted((r.task_id, r.reward, r.worker == "kept") for r in got) == [(a, 1.0, False), (b, 1.0, False)]
    assert stale_replays(got, [a, b], scripts, chat) is None


def _config_file(tmp_path: Path, tasks_dir: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(CONFIG.format(tasks=tasks_dir) + SFT)
    return path


def _chat(tags: str):
    from shipyard.harness.tools import default_tools
    from shipyard.harness.wire import ChatFormat
    from shipyard.models.resolve import load_tokenizer

    return ChatFormat(load_tokenizer("qwen2.5-coder-0.5b", lambda _: None), default_tools(), tags=tags)


def test_gold_demonstrations_write_the_call_tags_as_the_runs_wire_does():
    """The bundled Qwen's `<tool_call>` token is untrained (the reason for `tags = "spelled"`): a gold replay encoded
    with the tokenizer's own split taught the policy that token, and the SFT policy ended its turns where the tag
    belonged (2026-12-06: 23 of 32 held-out episodes one prose turn long). Replays are encoded as the policy writes
    under the run's wire, and a demonstration with the tag tokens is refused under spelled tags."""
    from shipyard.models.engine import GenerationRequest, SamplingParams
    from shipyard.models.replay import ReplayEngine
    from shipyard.rl.sft import _check_rendering, written_with_tag_tokens

    message = 'I will read it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
    spelled, token = _chat("spelled"), _chat("token")
    tags = spelled.tag_ids()
    assert len(tags) == 2  # each tag one token of this tokenizer
    request = GenerationRequest(prompt_ids=[1, 2], sampling=SamplingParams(max_tokens=200))
    for chat, holds in ((spelled, False), (token, True)):
        engine = ReplayEngine([message], tokenizer=chat.tokenizer, encode=chat.completion_ids)
        [done] = engine.generate([request])
        assert (not tags.isdisjoint(done.token_ids)) is holds
        assert chat.tokenizer.decode(done.token_ids) == message  # the same text either way
    with_tokens = _rollout("a")
    with_tokens.trajectory.turns[0].completion_ids = token.completion_ids(message)
    assert written_with_tag_tokens(with_tokens, spelled) and not written_with_tag_tokens(with_tokens, token)
    assert not written_with_tag_tokens(_rollout("a"), spelled)
    with pytest.raises(UserError, match="writes the call tags as control tokens"):
        _check_rendering("f.jsonl", with_tokens, "s", spelled, ())
