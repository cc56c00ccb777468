"""Agent-loop acceptance: scripted (replayed) sessions on the example repository."""

import json
import subprocess
import sys
import time

import pytest
import torch

from shipyard.harness.loop import Agent, LoopConfig
from shipyard.harness.trajectory import REPEAT_NOTE, Trajectory
from shipyard.harness.wire import ChatFormat
from shipyard.models.local import LocalEngine
from shipyard.models.replay import ReplayEngine, ReplayExhausted
from shipyard.models.resolve import TINY, load_hf


def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>\n'


BUG = ("        while number >= value:", "        while number > value:")


@pytest.fixture
def buggy(repo):
    path = repo / "pocketlib/roman.py"
    path.write_text(path.read_text().replace(*BUG, 1))
    return repo


def test_scripted_fix_session(buggy, workspace, tmp_path):
    script = [
        "Let me read the code and its tests.\n" + call("read_file", path="pocketlib/roman.py")
        + call("read_file", path="tests/test_roman.py"),
        "The loop condition skips the last symbol.\n"
        + call("search_replace", path="pocketlib/roman.py", old_string=BUG[1], new_string=BUG[0]),
        call("run_terminal", command=f"{sys.executable} -m pytest -q -p no:cacheprovider tests/test_roman.py"),
        "Fixed: `to_roman` now emits a symbol while the number is at least its value.",
    ]
    out = tmp_path / "traj.json"
    traj = Agent(ReplayEngine(script), workspace).run("fix the failing tests", out=str(out))
    assert traj.stop_reason == "finished" and len(traj.turns) == 4
    assert traj.turns[0].parallel_width == 2
    assert [c.name for c in traj.turns[0].calls] == ["read_file", "read_file"]
    assert "def to_roman" in traj.turns[0].calls[0].output and "test_to_roman" in traj.turns[0].calls[1].output
    assert "passed" in traj.turns[2].calls[0].output and "[exit code 0]" in traj.turns[2].calls[0].output
    assert all(c.error is None for t in traj.turns for c in t.calls)
    expected = "\n".join(["--- a/pocketlib/roman.py", "+++ b/pocketlib/roman.py"])
    assert expected in traj.patch and f"-{BUG[1]}" in traj.patch and f"+{BUG[0]}" in traj.patch
    assert traj.patch.count("diff --git") == 1
    assert subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=buggy,
                          capture_output=True).returncode == 0
    loaded = Trajectory.load(out)
    assert loaded.summary() == traj.summary() and loaded.token_ids() == traj.token_ids()


def test_hostile_session_reports_every_error_and_touches_nothing_outside(repo, workspace, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    script = [
        "<tool_call>this is not json</tool_call>",
        call("launch_missiles", target="moon") + call("read_file", path="../../etc/passwd"),
        call("read_file", offset="ten") + call("write_file", path="../outside.txt", content="pwned"),
        call("delete_file", path=str(outside)) + call("search_replace", path="/etc/hosts", old_string="a",
                                                       new_string="b"),
        '<tool_call>{"name": "grep", "arguments": {"pattern": "x"}, "extra": 1}</tool_call><tool_call>{"name": "gl',
        call("list_dir", path="."),
        "I give up.",
    ]
    traj = Agent(ReplayEngine(script), workspace, LoopConfig(max_failed_turns=10)).run("do harm")
    assert traj.stop_reason == "finished"
    errors = [c.error for t in traj.turns for c in t.calls if c.error]
    assert len(errors) == 9
    joined = "\n".join(errors)
    for needle in ("must be a JSON object", "unknown tool 'launch_missiles'", "outside the workspace",
                   "'path' is a required property", "'ten' is not of type 'integer'", "unexpected keys",
                   "not closed with </tool_call>"):
        assert needle in joined
    # Every error reached the model as a tool response.
    for t in traj.turns:
        for c in t.calls:
            assert c.output.startswith("error: ") == (c.error is not None)
    assert outside.read_text() == "keep me"
    assert traj.patch == ""


def test_a_repeated_call_is_answered_with_its_result_and_the_turn_it_repeats(workspace):
    """Same tool, same arguments (in any order) as a call of an earlier turn: the result comes back as always, with a
    one-line note naming the earliest such turn (1-based, as the model counts); other calls, a call repeated within
    its own turn and a call that did not parse are not noted. The note is in what the model reads next."""
    reordered = '<tool_call>\n{"name": "read_file", "arguments": {"limit": 3, "path": "README.md"}}\n</tool_call>\n'
    script = [
        call("read_file", path="README.md", limit=3),
        call("list_dir", path=".") + reordered,  # turn 2: read_file repeats turn 1
        call("read_file", path="README.md", limit=4) + call("list_dir", path="."),  # new; repeats turn 2
        call("read_file", path="missing.py") + call("read_file", path="missing.py"),  # fails; same turn: no note
        call("read_file", path="missing.py") + call("glob", pattern="*.md") + call("nope") + call("nope"),
        call("read_file", path="README.md", limit=3) + call("nope"),  # repeats turn 1 still (the earliest)
        "done",
    ]
    engine = ReplayEngine(script)
    traj = Agent(engine, workspace, LoopConfig(max_failed_turns=10)).run("x")
    assert traj.stop_reason == "finished"

    def notes(turn):
        return [next((n for n in range(1, 7) if c.output.endswith("\n" + REPEAT_NOTE.format(turn=n))), None)
                for c in turn.calls]

    assert [notes(t) for t in traj.turns[:6]] == [[None], [None, 1], [None, 2], [None, None], [4, None, None, None],
                                                   [1, None]]
    first, repeat = traj.turns[0].calls[0].output, traj.turns[1].calls[1].output
    assert repeat == first + ("" if first.endswith("\n") else "\n") + REPEAT_NOTE.format(turn=1)  # the result too
    assert traj.turns[4].calls[0].output.startswith("error: ")  # a failed call repeated: its error, and the note
    assert REPEAT_NOTE.format(turn=1) in engine.tokenizer.decode(traj.turns[1].observation_ids)
    assert REPEAT_NOTE.count("\n") == 0


def test_stuck_model_stops_on_repeated_failures(workspace):
    """After 5 turns in which every call failed by default (docs/harness.md: 3 was too quick for a model learning the
    format), or as many as `max_failed_turns` says; one turn with a call that ran starts the count again."""
    traj = Agent(ReplayEngine([call("nope")] * 7), workspace).run("x")
    assert traj.stop_reason == "repeated_failures" and len(traj.turns) == 5
    script = [call("nope")] * 2 + [call("list_dir", path=".")] + [call("nope")] * 5
    traj = Agent(ReplayEngine(script), workspace, LoopConfig(max_failed_turns=3)).run("x")
    assert traj.stop_reason == "repeated_failures" and len(traj.turns) == 6


def test_max_turns(workspace):
    traj = Agent(ReplayEngine([call("list_dir")] * 5), workspace, LoopConfig(max_turns=2)).run("x")
    assert traj.stop_reason == "max_turns" and len(traj.turns) == 2


def test_max_tokens_budget(workspace):
    engine = ReplayEngine([call("list_dir")] * 20)
    prompt_len = len(ChatFormat(engine.tokenizer, Agent(engine, workspace).tools).prompt_ids("x"))
    traj = Agent(engine, workspace, LoopConfig(max_tokens=prompt_len + 1000, overview_entries=0)).run("x")
    assert traj.stop_reason == "max_tokens" and 1 < len(traj.turns) < 20
    assert len(traj.token_ids()) >= prompt_len + 1000
    # a first prompt over the budget is no episode of the model's: masked with its cause, never a 0
    short = Agent(engine, workspace, LoopConfig(max_tokens=prompt_len - 1, overview_entries=0)).run("x")
    assert short.stop_reason == "infra_error" and short.turns == []
    assert short.meta["infra_error"].startswith(f"prompt: PromptTooLong: the first prompt is {prompt_len} tokens")


def test_wall_time(workspace):
    traj = Agent(ReplayEngine([call("list_dir")]), workspace, LoopConfig(wall_time=1e-9)).run("x")
    assert traj.stop_reason == "wall_time" and traj.turns == []


def test_replay_exhausted_is_an_error(workspace):
    with pytest.raises(ReplayExhausted, match="no tool call"):
        Agent(ReplayEngine([call("list_dir")]), workspace).run("x")


def test_parallel_terminal_calls_run_concurrently(workspace, tmp_path):
    # A barrier: each command marks that it started, then waits until all eight have, so every one returns "met" only
    # if the eight ran side by side. Run one after another, the first would wait out its 30 s and give up, and each
    # later one would see that and give up at once: "alone".
    marks = tmp_path / "marks"
    marks.mkdir()
    started = f"$(ls {marks} | grep -c started)"
    barrier = tmp_path / "barrier.sh"
    barrier.write_text(f"touch {marks}/started-$1; n=0\n"
                       f"while [ {started} -lt 8 ] && [ ! -e {marks}/gave-up ] && [ $n -lt 600 ]; do\n"
                       "  sleep 0.05; n=$((n + 1))\ndone\n"
                       f"if [ {started} -ge 8 ]; then echo job$1 met\n"
                       f"else touch {marks}/gave-up; echo job$1 alone; fi\n")
    turn = "".join(call("run_terminal", command=f"sh {barrier} {i}") for i in range(8))
    traj = Agent(ReplayEngine([turn, "done"]), workspace).run("x")
    first = traj.turns[0]
    assert first.parallel_width == 8
    assert [c.output.split("\n")[0] for c in first.calls] == [f"job{i} met" for i in range(8)]  # together, in order


def test_same_file_calls_run_in_call_order(repo, workspace):
    turn = (call("search_replace", path="pocketlib/stats.py", old_string="def mean(", new_string="def average(")
            + call("read_file", path="pocketlib/stats.py") + call("grep", pattern="def average"))
    traj = Agent(ReplayEngine([turn, "done"]), workspace).run("x")
    edit, read, _ = traj.turns[0].calls
    assert edit.error is None and "def average(" in read.output


def test_edit_then_test_in_one_turn_sees_the_edit(buggy, workspace):
    turn = (call("search_replace", path="pocketlib/roman.py", old_string=BUG[1], new_string=BUG[0])
            + call("run_terminal", command=f"{sys.executable} -m pytest -q -p no:cacheprovider tests/test_roman.py")
            + call("grep", pattern=BUG[0].strip()) + call("run_terminal", command="git --version || true"))
    traj = Agent(ReplayEngine([turn, "done"]), workspace).run("x")
    edit, tests, grep, _ = traj.turns[0].calls
    assert edit.error is None and "[exit code 0]" in tests.output and "roman.py" in grep.output


def test_schedule_waves(workspace):
    from shipyard.harness.loop import ToolExecutor
    from shipyard.harness.parse import ToolCallParser
    from shipyard.harness.tools import ToolContext, default_tools

    tools = default_tools()
    executor = ToolExecutor(tools, ToolContext(workspace))
    text = (call("read_file", path="a.py") + call("read_file", path="b.py") + call("run_terminal", command="1")
            + call("run_terminal", command="2") + call("write_file", path="a.py", content="")
            + call("grep", pattern="x") + call("read_file", path="b.py"))
    waves = executor._waves(ToolCallParser(tools).parse(text).calls)
    assert [[c.index for c in w] for w in waves] == [[0, 1], [2, 3], [4, 6], [5]]
    executor.close()


def test_token_views_are_consistent(workspace):
    traj = Agent(ReplayEngine([call("list_dir"), call("glob", pattern="*.md"), "done"]), workspace).run("x")
    ids, mask, lps = traj.token_ids(), traj.loss_mask(), traj.sampler_logprobs()
    assert len(ids) == len(mask) == len(lps)
    assert sum(mask) == sum(len(t.completion_ids) for t in traj.turns)
    sampled = [i for i, m in zip(ids, mask, strict=True) if m]
    assert sampled == [i for t in traj.turns for i in t.completion_ids]
    text = ReplayEngine(["x"]).tokenizer.decode(ids)
    assert text.count("<tool_response>") == 2 and text.endswith("done<|im_end|>")


def test_random_model_episode_ends_normally(workspace):
    model, tok = load_hf(TINY, dtype=torch.float32)
    engine = LocalEngine(model, tok)
    start = time.monotonic()
    traj = Agent(engine, workspace, LoopConfig(max_turns=2, max_new_tokens=64, seed=0)).run("fix it")
    # which normal end depends on a random model's text; never max_tokens, wall_time, infra_error or cancelled
    assert traj.stop_reason in ("finished", "max_turns", "repeated_failures") and 1 <= len(traj.turns) <= 2
    assert time.monotonic() - start < 60
    assert all(len(t.logprobs) == len(t.completion_ids) for t in traj.turns)


# Faults are data: infrastructure failures and cancellation end the episode with their own stop reason -------------

class Scripted:
    """A replay engine that records every request and runs `hooks[k]` before answering request k (0-based): a real
    `Engine`, whose hook may raise what a failing server raises or break the workspace mid-episode."""

    def __init__(self, messages, hooks=None, versions=None):
        self.replay = ReplayEngine(messages)
        self.name, self.tokenizer, self.policy_version = "scripted", self.replay.tokenizer, -1
        self.requests, self.hooks, self.versions = [], hooks or {}, versions

    def generate(self, requests):
        k = len(self.requests)
        self.requests += requests
        if k in self.hooks:
            self.hooks[k]()
        out = self.replay.generate(requests)
        if self.versions is not None:
            for c in out:
                c.token_versions = [self.versions(i) for i in range(len(c.token_ids))]
        return out

    def close(self):
        pass


class FailingWorkspace:
    """A local workspace whose `run` fails as an unreachable environment server's would once `broken` is set."""

    def __init__(self, inner):
        self.inner, self.broken = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, argv, **kwargs):
        from shipyard.sandbox.client import EnvServerUnreachable

        if self.broken:  # an OSError (ConnectionError) too: must not be reported to the model as a tool error
            raise EnvServerUnreachable("cannot reach the environment server at http://127.0.0.1:9")
        return self.inner.run(argv, **kwargs)


def test_engine_infra_error_ends_the_episode_and_keeps_the_trajectory(workspace, tmp_path):
    from shipyard.models.errors import ServerUnreachable

    def lost():
        raise ServerUnreachable("lost the server at http://127.0.0.1:9/v1")

    engine = Scripted([call("list_dir", path="."), call("list_dir", path="."), "done"], hooks={1: lost})
    out = tmp_path / "t.json"
    traj = Agent(engine, workspace).run("look", out=str(out))
    assert traj.stop_reason == "infra_error" and len(traj.turns) == 1 and traj.turns[0].calls[0].error is None
    assert traj.meta["infra_error"].startswith("generate: ServerUnreachable: lost the server")
    assert traj.patch == "" and Trajectory.load(out).stop_reason == "infra_error"


def test_workspace_infra_error_is_not_a_tool_error(workspace):
    ws = FailingWorkspace(workspace)
    engine = Scripted([call("run_terminal", command="echo one"), call("run_terminal", command="echo two"), "done"],
                      hooks={1: lambda: setattr(ws, "broken", True)})
    traj = Agent(engine, ws).run("shell")
    assert traj.stop_reason == "infra_error", [c.output for t in traj.turns for c in t.calls]
    assert len(traj.turns) == 2 and "one" in traj.turns[0].calls[0].output
    assert traj.turns[1].calls == [] and traj.turns[1].observation_ids == []  # its completion kept, nothing run
    assert traj.meta["infra_error"].startswith("tools: EnvServerUnreachable")
    assert len(traj.token_ids()) == len(traj.loss_mask()) == len(traj.sampler_logprobs())


def test_cancelled_between_turns_and_passed_to_every_request(workspace):
    engine = Scripted([call("list_dir", path=".")] * 5 + ["done"])
    cancel = lambda: len(engine.requests) >= 2  # noqa: E731
    traj = Agent(engine, workspace, session="g/3", cancelled=cancel).run("look")
    assert traj.stop_reason == "cancelled" and len(traj.turns) == 2
    assert all(r.session == "g/3" for r in engine.requests)
    flags = {"set": False}
    cancel = lambda: flags["set"]  # noqa: E731
    engine = Scripted([call("list_dir", path="."), "done"])
    Agent(engine, workspace, cancelled=cancel).run("look")
    assert engine.requests[0].cancelled() is False
    flags["set"] = True  # the request's callback is the episode's cancellation (or its wall time)
    assert engine.requests[0].cancelled() is True


def test_generation_aborted_by_cancel_keeps_the_partial_turn_and_runs_none_of_it(workspace):
    flag = {"set": False}

    class Aborting(Scripted):
        def generate(self, requests):
            out = super().generate(requests)
            if requests[0].cancelled():  # what an engine does between decode steps once cancelled
                out[0].finish_reason, out[0].token_ids = "abort", out[0].token_ids[:5]
            return out

    engine = Aborting([call("list_dir", path="."), call("write_file", path="x.txt", content="x"), "done"],
                      hooks={1: lambda: flag.update(set=True)})
    traj = Agent(engine, workspace, cancelled=lambda: flag["set"]).run("look")
    assert traj.stop_reason == "cancelled" and len(traj.turns) == 2
    assert traj.turns[1].finish_reason == "abort" and traj.turns[1].calls == [] and "x.txt" not in traj.patch


def test_wall_time_stops_a_generation_mid_turn_and_is_the_models_not_a_cancellation(workspace):
    # An engine polls the request's callback between decode steps: past the wall time it aborts, and the episode
    # ends with `wall_time` (scored), never `cancelled` (masked) — a slow policy cannot choose to be masked.
    class Slow(Scripted):
        stopped = None  # whether the request's callback said stop (not the engine's own give-up time)

        def generate(self, requests):
            out = super().generate(requests)
            deadline = time.monotonic() + 60
            while not requests[0].cancelled() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.stopped = requests[0].cancelled()
            out[0].finish_reason, out[0].token_ids = "abort", out[0].token_ids[:3]
            return out

    engine = Slow([call("list_dir", path="."), "done"])
    traj = Agent(engine, workspace, LoopConfig(wall_time=0.3)).run("look")
    assert engine.stopped is True  # the wall time stopped the generation, between decode steps
    assert traj.stop_reason == "wall_time" and len(traj.turns) == 1 and traj.turns[0].calls == []
    assert traj.seconds >= 0.3  # and not before the wall time was up


def test_turns_carry_per_token_versions(workspace):
    traj = Agent(Scripted(["done"], versions=lambda i: 3 if i < 2 else 4), workspace).run("x")
    assert traj.turns[0].token_versions[:3] == [3, 3, 4]
