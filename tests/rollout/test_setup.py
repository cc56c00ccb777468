"""Opening an eval run as a library (`shipyard.rollout.setup`, `select_tasks`, `save_results`): what `shipyard eval`,
benchmarks and `shipyard train` share, tested without the command line — hostile task ids and task sets first."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from servers import free_port, needs_sandbox

from shipyard.rollout.eval import ResultsFileError, load_results, save_results
from shipyard.rollout.setup import (
    GOLD,
    SandboxesUnavailable,
    check_sandboxes,
    fit_turn_budget,
    open_engine,
    open_environment,
    select_tasks,
)
from shipyard.tasks.taskset import TaskFormatError


def _sandbox_problem():
    from shipyard.sandbox.run import sandbox_problem

    return sandbox_problem()


# hostile input -----------------------------------------------------------------------------------------------------
def test_select_tasks_refuses_what_is_not_a_task_set_or_holds_no_task(tmp_path):
    with pytest.raises(TaskFormatError, match="is not a task set"):
        select_tasks(tmp_path)
    (tmp_path / "tasks.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no tasks"):
        select_tasks(tmp_path)
    for hostile in ("../etc", "/etc", "a/../../b", ""):
        with pytest.raises(TaskFormatError, match=f"^task id '{re.escape(hostile)}' is invalid: use 1-64 letters"):
            select_tasks(tmp_path, [hostile])  # before any episode; never a path used


@needs_sandbox
def test_select_tasks_keeps_order_drops_duplicates_and_names_an_unknown_task(taskset):
    from shipyard.tasks.taskset import list_tasks

    tasks_dir, _, _ = taskset
    ids = list_tasks(tasks_dir)
    assert select_tasks(tasks_dir) == ids
    assert select_tasks(tasks_dir, [ids[1], ids[0], ids[1]]) == [ids[1], ids[0]]
    with pytest.raises(TaskFormatError, match="no task 'nope'"):
        select_tasks(tasks_dir, [ids[0], "nope"])


@needs_sandbox
def test_gold_engine_needs_the_task_set_and_refuses_a_task_without_gold_patch(taskset, tmp_path):
    from shipyard.rollout.gold import GoldError
    from shipyard.tasks.taskset import list_tasks

    tasks_dir, _, _ = taskset
    with pytest.raises(ValueError, match="replays the gold patches of a task set"):
        open_engine(GOLD)
    copy = tmp_path / "tasks"
    shutil.copytree(tasks_dir, copy, symlinks=True)
    ids = list_tasks(copy)
    (copy / ids[0] / "gold.patch").unlink()
    with pytest.raises(GoldError, match="has no gold"):
        open_engine(GOLD, tasks_dir=copy)
    engine = open_engine(GOLD, tasks_dir=copy, task_ids=ids[1:])  # only the tasks being run need a gold patch
    assert engine.name == GOLD and sorted(engine.scripts) == sorted(ids[1:])
    # with a tokenizer and a loop, the replies are the ids a policy writes under the loop's wire: under spelled tags
    # never the `<tool_call>` token the bundled Qwen cannot write (else `shipyard sft` refuses them as demonstrations)
    from shipyard.harness.loop import LoopConfig
    from shipyard.harness.tools import default_tools
    from shipyard.harness.wire import ChatFormat

    reply = 'Reading it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
    for tags in ("spelled", "token"):
        engine = open_engine(GOLD, tasks_dir=copy, task_ids=ids[1:], tokenizer="qwen2.5-coder-0.5b",
                             loop=LoopConfig(tags=tags))
        chat = ChatFormat(engine.tokenizer, default_tools(), tags=tags)
        assert engine.encode(reply) == chat.completion_ids(reply)
        assert chat.tag_ids().isdisjoint(engine.encode(reply)) is (tags == "spelled")


def test_replay_turn_budget_is_raised_to_replay_the_longest_message_whole():
    from shipyard.models.engine import GenerationRequest, SamplingParams
    from shipyard.models.replay import ReplayEngine
    from shipyard.rollout.episode import episode_config

    long = "x" * 50 + " <tool_call>{}</tool_call>"
    engine = ReplayEngine([long, "done"])
    loop = episode_config("replay", max_new_tokens=8).loop
    stop = engine.tokenizer.eos_token_id

    def replay(budget: int):
        return engine.generate([GenerationRequest([1], SamplingParams(max_tokens=budget, stop_token_ids=(stop,)),
                                                  session=f"s{budget}")])[0]

    assert replay(loop.max_new_tokens).finish_reason == "length"  # the budget given would cut the message
    assert fit_turn_budget(engine, loop) == engine.longest() + 1 == loop.max_new_tokens
    whole = replay(loop.max_new_tokens)
    assert whole.finish_reason == "stop" and whole.text == long and len(whole.token_ids) == loop.max_new_tokens
    assert fit_turn_budget(engine, loop) is None  # big enough now: left as it is
    assert fit_turn_budget(engine, episode_config("replay", max_new_tokens=10_000).loop) is None


# environments ------------------------------------------------------------------------------------------------------
def test_an_environment_server_is_only_contacted_by_episodes(tmp_path):
    """Opening a remote environment sends nothing: a dead server fails each episode (infra_error, retried and
    masked by the scheduler), it does not fail the opening."""
    url = f"http://127.0.0.1:{free_port()}"
    env = open_environment(url)
    try:
        assert env.name == f"remote:{url}"
    finally:
        env.close()


def test_local_environment_opens_only_where_sandboxes_start():
    problem = _sandbox_problem()
    if problem is not None:
        with pytest.raises(SandboxesUnavailable, match="this host cannot start bubblewrap sandboxes: "):
            open_environment()
        return
    check_sandboxes()
    env = open_environment()
    try:
        assert env.name == "local"
    finally:
        env.close()


# results files -----------------------------------------------------------------------------------------------------
def test_save_results_round_trips_through_load_results_and_makes_its_folder(tmp_path):
    from shipyard.rollout.eval import results
    from shipyard.rollout.record import Rollout

    doc = results({"t": [Rollout(task_id="t", group_id="t@eval", index=0, seed=1, status="graded", reward=1.0)]},
                  [1], config={"model": "m"}, wall_seconds=1.0)
    path = save_results(doc, tmp_path / "deep" / "r.json")
    assert load_results(path) == json.loads(json.dumps(doc))
    path.write_text(path.read_text()[:-10])  # a file cut short is refused, naming the file
    with pytest.raises(ResultsFileError, match="r.json is not a shipyard eval result: not JSON"):
        load_results(path)
