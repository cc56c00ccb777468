"""Hint detectors on real episodes: the agent loop runs scripted turns (`ReplayEngine`) against a copy of the example
repository, so every call record, error kind and output is what the harness really produced; the detectors must
find each behaviour at its turn, and no hint may carry an identifier of the task's deleted code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shipyard.harness.loop import Agent, LoopConfig
from shipyard.harness.tools import default_tools
from shipyard.harness.trajectory import Trajectory
from shipyard.harness.wire import ChatFormat
from shipyard.models.replay import ReplayEngine
from shipyard.rl.config import HintsConfig
from shipyard.rl.critic import Critic
from shipyard.rl.hints import HINTS, HintWriter, TaskFacts, detect, hint
from shipyard.rollout.batches import RolloutBatch, RolloutGroup
from shipyard.rollout.record import Rollout
from shipyard.tasks.taskset import DeletedSymbol, Task
from shipyard.train.batch import Batch

FACTS = TaskFacts("`.venv/bin/python -m pytest`", frozenset({"tests/test_stats.py"}),
                  frozenset({"_require", "ordered"}))


def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>\n'


def episode(workspace, *turns, untagged="reject", facts=FACTS, **kw):
    traj = Agent(ReplayEngine(list(turns)), workspace, LoopConfig(untagged_calls=untagged, max_turns=12)).run("task")
    return traj, detect(traj, facts, **kw)


def found(findings):
    return [(f.turn, f.kind) for f in findings]


def test_format_errors_are_found_at_their_turn_and_the_episode_goes_on(workspace):
    traj, findings = episode(workspace, call("list_dir", path="."),
                             '{"name": "read_file", "arguments": {"path": "README.md"}}',  # untagged: rejected
                             call("open_file", path="README.md") + call("list_dir"),
                             '<tool_call>{"name": "read_file", "arguments": {"path": }}</tool_call>',
                             call("read_file", offset="3"), "Done.", detectors=["call_format"])
    assert [c.error_kind for t in traj.turns for c in t.calls] == [None, "untagged", "unknown_tool", None,
                                                                   "malformed", "bad_arguments"]
    assert found(findings) == [(1, "call_format"), (2, "call_format"), (3, "call_format"), (4, "call_format")]
    texts = [f.hint for f in findings]
    assert "<tool_call>" in texts[0] and "read_file, list_dir" in texts[1] and "JSON" in texts[2]
    assert "schema" in texts[3]


def test_an_untagged_call_is_shown_back_in_its_tags(workspace):
    """The hint holds the exact text the turn should have had: the model's own call in the system prompt's form."""
    for untagged in ("accept", "reject"):
        _, findings = episode(workspace, 'Listing.\n{"name": "list_dir", "arguments": {"path": "."}}', "Done.",
                              untagged=untagged, detectors=["call_format"])
        assert found(findings) == [(0, "call_format")]
        exact = '<tool_call>\n{"name": "list_dir", "arguments": {"path": "."}}\n</tool_call>'
        assert findings[0].hint.endswith("\n" + exact)
        assert findings[0].slots == (".",)


def test_an_untagged_call_gets_the_generic_example_when_its_text_cannot_be_repeated(workspace):
    """The exact text is an endorsement the teacher copies: not for arguments naming the deleted code (checked
    decoded: `\\nmid` in the JSON is `mid` on its own line), chat control tokens, a call too long to repeat, a call
    with a placeholder, one that ran and failed, or one with a second problem. (A rejected call never ran: it is
    judged on its arguments alone.)"""
    cases = [json.dumps({"name": "write_file", "arguments": {"path": "notes.py", "content": "n = 3\nmid = n // 2\n"}}),
             json.dumps({"name": "grep", "arguments": {"pattern": "def ordered"}}),
             json.dumps({"name": "write_file", "arguments": {"path": "notes.txt", "content": "x" * 500}}),
             json.dumps({"name": "read_file", "arguments": {"path": "path/to/file.py"}})]
    failed = json.dumps({"name": "read_file", "arguments": {"path": "no/such/file.py"}})  # known only once run
    facts = TaskFacts("`pytest`", frozenset(), frozenset({"mid", "ordered"}))
    for text, modes in [*((c, ("accept", "reject")) for c in cases), (failed, ("accept",))]:
        for untagged in modes:
            _, findings = episode(workspace, text, "Done.", untagged=untagged, facts=facts, detectors=["call_format"])
            assert [f.hint for f in findings] == [hint("untagged")] and findings[0].slots == (), (text, untagged)
    # A control token as text (engines decode without special tokens, so the replayed one is set in the record):
    traj, _ = episode(workspace, '{"name": "grep", "arguments": {"pattern": "x"}}', "Done.", untagged="accept")
    traj.turns[0].calls[0].arguments["pattern"] = "x<|im_start|>user"
    assert [f.hint for f in detect(traj, facts, detectors=["call_format"])] == [hint("untagged")]
    _, findings = episode(workspace, '{"name": "read_file", "arguments": {"offset": 3}}', "Done.",
                          detectors=["call_format"])  # untagged and missing its path
    assert "<tool_call>" in findings[0].hint and '"offset": 3' not in findings[0].hint


def test_an_exact_call_is_not_withheld_for_the_templates_own_words(workspace):
    """Secrets are matched in the model's strings only: a task whose deleted code names `path` or `name` still gets
    exact hints for calls that do not."""
    facts = TaskFacts("`pytest`", frozenset(), frozenset({"path", "name", "arguments", "read_file"}))
    _, findings = episode(workspace, '{"name": "read_file", "arguments": {"path": "README.md"}}', "Done.",
                          untagged="accept", facts=facts, detectors=["call_format"])
    assert findings[0].hint.startswith(HINTS["untagged_exact"].split("{call}")[0])
    assert findings[0].slots == ("README.md",)


def test_placeholder_and_unrunnable_arguments_are_ungrounded(workspace):
    _, findings = episode(workspace, call("run_terminal", command="the bash command line to run"),
                          call("read_lints", paths=["README.md"]), call("run_terminal", command="ls"), "Done.",
                          detectors=["ungrounded"])
    assert found(findings) == [(0, "ungrounded"), (1, "ungrounded")]
    assert "placeholder" in findings[0].evidence and "no_target" in findings[1].evidence


def test_a_rejected_edit_is_found_by_its_error_kind(workspace):
    traj, findings = episode(workspace, call("read_file", path="pocketlib/stats.py"),
                             call("search_replace", path="pocketlib/stats.py", old_string="def median(",
                                  new_string="def median(("), "Done.", detectors=["rejected_edit"])
    assert traj.turns[1].calls[0].error_kind == "rejected_edit"
    assert found(findings) == [(1, "rejected_edit")]


def test_an_edit_of_a_file_never_read_before_that_turn(workspace):
    edit = call("search_replace", path="pocketlib/stats.py", old_string="def median(", new_string="def  median(")
    read = call("read_file", path="pocketlib/stats.py")
    _, blind = episode(workspace, edit, "Done.", detectors=["unread_edit"])
    _, same_turn = episode(workspace, read + edit, "Done.", detectors=["unread_edit"])
    _, after_read = episode(workspace, read, edit, "Done.", detectors=["unread_edit"])
    assert found(blind) == [(0, "unread_edit")] and found(same_turn) == [(0, "unread_edit")]
    assert after_read == [] and "pocketlib/stats.py" in blind[0].hint
    _, dotted = episode(workspace, call("read_file", path="./pocketlib/stats.py"), edit, "Done.",
                        detectors=["unread_edit"])
    _, written = episode(workspace, call("write_file", path="new.py", content="x = 1\n"),
                         call("search_replace", path="new.py", old_string="x = 1", new_string="x = 2"), "Done.",
                         detectors=["unread_edit"])
    _, malformed = episode(workspace, call("search_replace", path=["a.py"], old_string="a", new_string="b"), "Done.",
                           detectors=["unread_edit"])
    assert dotted == [] and written == [] and malformed == []  # the same file; written whole; no path to name


def test_an_identical_failing_call_repeated(workspace):
    missing = call("read_file", path="nothing_here.py")
    _, findings = episode(workspace, missing, call("list_dir"), missing, call("read_file", path="other.py"), "Done.",
                          detectors=["repeated_failure"])
    assert found(findings) == [(2, "repeated_failure")]


def test_editing_the_tests(workspace):
    _, findings = episode(workspace, call("read_file", path="tests/test_stats.py"),
                          call("write_file", path="tests/test_stats.py", content="def test_ok():\n    pass\n"),
                          call("write_file", path="notes/test_plan.py", content="x = 1\n"),
                          call("write_file", path="pocketlib/helpers.py", content="x = 1\n"), "Done.",
                          detectors=["test_edit"])
    assert found(findings) == [(1, "test_edit"), (2, "test_edit")]


def test_independent_calls_made_one_per_turn(workspace):
    _, serial = episode(workspace, call("read_file", path="README.md"), call("read_file", path="pocketlib/stats.py"),
                        "Done.", detectors=["serial_calls"])
    # the second call's target was in the first call's output: it depended on it
    _, dependent = episode(workspace, call("list_dir", path="pocketlib"), call("read_file", path="pocketlib/stats.py"),
                           "Done.", detectors=["serial_calls"])
    _, parallel = episode(workspace, call("read_file", path="README.md") + call("read_file", path="pocketlib/stats.py"),
                          "Done.", detectors=["serial_calls"])
    assert found(serial) == [(0, "serial_calls")] and dependent == [] and parallel == []


def test_long_prose_for_a_simple_step(workspace):
    prose = "I think about this carefully. " * 30
    _, findings = episode(workspace, prose + call("list_dir"), "Short. " + call("list_dir"),
                          prose + call("write_file", path="a.py", content="x = 1\n"), "Done.",
                          detectors=["verbose_step"], verbose_words=100)
    assert found(findings) == [(0, "verbose_step")]


def test_finishing_untested_unchanged_or_tested(workspace, repo):
    edit = call("write_file", path="pocketlib/helpers.py", content="x = 1\n")
    test = call("run_terminal", command="python -m pytest -q --collect-only tests/test_stats.py")
    _, unchanged = episode(workspace, call("list_dir"), "Done.", detectors=["finished"])
    _, untested = episode(workspace, test, edit, "Done.", detectors=["finished"])
    _, tested = episode(workspace, edit, test, "Done.", detectors=["finished"])
    assert found(unchanged) == [(1, "finished_unchanged")] and found(untested) == [(2, "finished_untested")]
    assert tested == [] and "`.venv/bin/python -m pytest`" in untested[0].hint
    # changed through the terminal (the episode's patch is not empty), then tested: nothing to say
    terminal, _ = episode(workspace, call("run_terminal", command="echo 'x = 1' > pocketlib/extra.py"), test, "Done.")
    terminal.patch = "diff --git a/pocketlib/extra.py b/pocketlib/extra.py\n+x = 1\n"
    assert detect(terminal, FACTS, detectors=["finished"]) == []


def test_task_facts_keep_the_deleted_identifiers_the_statement_does_not_show():
    task = Task(id="t1-x", tier=1, statement="Implement `median(values)` in `pocketlib/stats.py`. Run the suite with "
                                             "`.venv/bin/python -m pytest`.",
                fail_to_pass=["tests/test_stats.py::test_median"], pass_to_pass=["tests/test_roman.py::test_is_roman"],
                deleted=[DeletedSymbol("pocketlib/stats.py", "median", 1, 3)], lines_deleted=2,
                source={"repo": "x", "commit": "y"})
    gold = ("--- a/pocketlib/stats.py\n+++ b/pocketlib/stats.py\n@@ -1,2 +1,3 @@\n def median(values):\n"
            "-    raise NotImplementedError\n+    ordered = sorted(_require(values))\n"
            "+    return ordered[len(ordered) // 2]\n")
    facts = TaskFacts.of(task, gold)
    assert facts.secret == {"ordered", "_require"}  # not values/median (shown), return/sorted/len (Python's own)
    assert facts.test_command == "`.venv/bin/python -m pytest`"
    assert facts.test_files == {"tests/test_stats.py", "tests/test_roman.py"}
    assert facts.leaks("tests/Ordered.py") and not facts.leaks("tests/test_stats.py")


def test_the_leak_check_finds_names_in_any_spelling_but_not_inside_ordinary_words():
    facts = TaskFacts(secret=frozenset({"from_roman", "out", "top", "end"}))
    for text in ("Call from roman on it.", "Use fromRoman inside a try block.", "tests/FROM_ROMAN_x.py",
                 "print out the value", "Stop at the end."):
        assert facts.leaks(text), text
    for text in ("Read the test output before you edit anything.", "Stop exploring and edit.",
                 "tests/test_endpoints.py", "Read the test's assertion first."):
        assert not facts.leaks(text), text


def _batch(trajs, masked=()):
    rollouts = [Rollout("task", "g0", i, seed=i, status="masked" if i in masked else "failed",
                        reward=None if i in masked else 0.0, trajectory=t, advantage=0.0) for i, t in enumerate(trajs)]
    return RolloutBatch([RolloutGroup("task", "g0", rollouts)])


class _Facts(HintWriter):
    def facts(self, task_id):
        return FACTS


def test_the_writer_merges_a_turns_findings_caps_turns_skips_masked_and_drops_leaks(workspace):
    tok = ReplayEngine(["x"]).tokenizer
    chat = ChatFormat(tok, default_tools())
    missing = call("read_file", path="nothing_here.py")
    leaky = call("search_replace", path="pocketlib/_require.py", old_string="a", new_string="b")  # a secret name
    trajs = [episode(workspace, missing, missing + call("write_file", path="tests/test_stats.py", content="x = 1\n"),
                     missing, "Done.")[0],
             episode(workspace, leaky, "Done.")[0],
             episode(workspace, missing, missing, "Done.")[0]]
    batch = _batch(trajs, masked={2})
    report = _Facts(workspace.root, chat, max_turns=1)(batch)
    first = [h for h in report.hints if h.sample == 0]
    assert [h.turn for h in first] == [1]  # turns 1 and 2 have findings; max_turns = 1 keeps the earliest
    assert set(first[0].kinds) == {"repeated_failure", "test_edit"} and "\n" in first[0].text
    assert first[0].hint_ids == chat.hint_ids(first[0].text)
    assert report.dropped_turns >= 1 and not any(h.sample == 2 for h in report.hints)
    assert report.dropped_leak == 1 and all("_require" not in h.text for h in report.hints)
    metrics = report.metrics()
    assert metrics["count"] == len(report.hints) and metrics["found_test_edit"] == 1
    batch.hints = report.hints
    tensors = Batch.from_rollouts(batch, pad_id=0, header_ids=chat.assistant_header_ids())
    assert len(tensors.hints) == len(report.hints)  # every hint lands before its turn's assistant header


def test_no_hint_carries_a_secret_identifier_whatever_the_model_wrote(workspace):
    """Every detector, on episodes whose calls name the deleted code's identifiers in paths and commands."""
    secret = call("search_replace", path="tests/_require_ordered.py", old_string="a", new_string="b")
    trajs = [episode(workspace, secret, secret, "Done.")[0],
             episode(workspace, call("write_file", path="tests/ordered.py", content="x = 1\n"), "Done.")[0],
             episode(workspace, call("read_file", path="_require.py"), call("read_file", path="ordered.py"),
                     "Done.")[0]]
    chat = ChatFormat(ReplayEngine(["x"]).tokenizer, default_tools())
    report = _Facts(workspace.root, chat, max_turns=10)(_batch(trajs))
    assert report.dropped_leak >= 2
    for h in report.hints:
        assert not FACTS.leaks(h.text), h.text


def test_every_hint_text_fills_and_stays_short():
    for kind in HINTS:
        text = hint(kind, tools="read_file, list_dir", path="pocketlib/stats.py", command="`pytest`",
                    call='<tool_call>\n{"name": "list_dir", "arguments": {"path": "."}}\n</tool_call>')
        assert len(text) < 300 and "{path}" not in text and "{command}" not in text, kind
    assert '{"name": "list_dir", "arguments": {"path": "."}}' in hint("untagged")


def test_malformed_records_do_not_stop_the_detectors(workspace):
    """Loaded JSON is not validated: odd arguments, outputs and texts must not raise inside a training step."""
    traj, _ = episode(workspace, call("read_file", path="README.md"), call("list_dir"), call("list_dir"), "Done.")
    traj.turns[0].calls[0].arguments = ["README.md"]
    traj.turns[0].calls[0].output = None
    traj.turns[1].text = None
    traj.turns[2].calls[0].arguments = "list_dir ."
    # the string arguments "list_dir ." echo the tool's name: a placeholder; the records' None and list are skipped
    assert [(f.turn, f.kind, f.evidence) for f in detect(traj, FACTS)] == [
        (2, "ungrounded", "call #1 (list_dir): placeholder"),
        (3, "finished_unchanged", "final answer without a successful edit or any change in the workspace")]


def test_a_critic_that_cannot_answer_costs_its_hints_not_the_step(workspace):
    from shipyard.models.errors import ServerUnreachable

    def unreachable(traj, statement, facts):
        raise ServerUnreachable("http://127.0.0.1:9 refused the connection")

    traj, _ = episode(workspace, call("list_dir"), "Done.")
    chat = ChatFormat(ReplayEngine(["x"]).tokenizer, default_tools())
    report = _Facts(workspace.root, chat, critic=unreachable)(_batch([traj]))
    assert report.critic_errors == 1 and "refused" in report.metrics()["critic_error"]
    assert [h.kinds for h in report.hints] == [("finished_unchanged",)]  # the detectors' hints still come


def test_config_names_the_detectors():
    assert HintsConfig().detectors and HintsConfig(detectors=("finished",)).detectors == ("finished",)
    with pytest.raises(ValueError, match="unknown hint detectors"):
        HintsConfig(detectors=("finished", "mind_reading"))


def test_an_identical_exploring_call_with_nothing_changed_since(workspace):
    _, again = episode(workspace, call("list_dir"), call("list_dir"), "Done.", detectors=["repeated_failure"])
    _, changed = episode(workspace, call("list_dir"), call("write_file", path="a.py", content="x = 1\n"),
                         call("list_dir"), "Done.", detectors=["repeated_failure"])
    assert found(again) == [(1, "repeated_call")] and changed == []


RECORDED = Path(__file__).parent / "data" / "qwen05b_trajectories.jsonl"


def test_recorded_episodes_of_the_bundled_model():
    """Three episodes the bundled Qwen2.5-Coder-0.5B wrote in the demo's 20-step run (docs/benchmarks.md): bare-JSON
    calls, a function of the task called as a tool, the same listing twice, a final answer with nothing changed."""
    rows = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    seen = [found(detect(Trajectory.from_dict(r["trajectory"]), TaskFacts())) for r in rows]
    assert seen[0] == [(0, "call_format"), (1, "call_format"), (2, "call_format"), (2, "repeated_call")]
    assert (0, "call_format") in seen[2] and (len(rows[2]["trajectory"]["turns"]) - 1, "finished_unchanged") in seen[2]
    first = detect(Trajectory.from_dict(rows[0]["trajectory"]), TaskFacts(), detectors=["call_format"])
    assert "read_file, list_dir" in first[0].hint and "<tool_call>" in first[1].hint  # unknown tool, then untagged


def test_a_critic_adds_hints_through_a_stricter_gate(workspace):
    """The critic is any engine (here a scripted one): its lines `TURN n: hint` become findings of kind critic,
    unless they point at no sampled turn, quote code, name a secret identifier or run long."""
    traj, _ = episode(workspace, call("list_dir"), call("read_file", path="README.md"), "Done.")
    answer = ("Looking at the episode.\nTURN 1: Read the file the failing test imports before anything else.\n"
              "TURN 0: Call `sorted(values)` first.\nTURN 7: Nothing.\nTURN 2: Mind the ordered list.\n"
              "TURN 0: " + "Be careful. " * 40 + "\nTURN 2: Run the tests before the final answer.")
    critic = Critic(ReplayEngine([answer]), max_hints=10, max_new_tokens=4000)
    findings, rejected = critic.review(traj, "Implement median.", FACTS)
    assert [(f.turn, f.kind, f.hint) for f in findings] == [
        (1, "critic", "Read the file the failing test imports before anything else."),
        (2, "critic", "Run the tests before the final answer.")]
    assert rejected == 4  # code, no such turn, a secret identifier (ordered), too long
    transcript = critic.transcript(traj, "Implement median.")
    assert "TASK:\nImplement median." in transcript and "TURN 1:" in transcript and "read_file" in transcript
    chat = ChatFormat(ReplayEngine(["x"]).tokenizer, default_tools())
    writer = _Facts(workspace.root, chat, max_turns=5, detectors=[],
                    critic=Critic(ReplayEngine([answer]), max_hints=10, max_new_tokens=4000).review)
    report = writer(_batch([traj]))
    assert [h.kinds for h in report.hints] == [("critic",), ("critic",)] and report.dropped_critic == 4
    cut = Critic(ReplayEngine([answer]), max_hints=10, max_new_tokens=100)  # cut off after "TURN 0: Call `so"
    findings, rejected = cut.review(traj, "x", FACTS)
    assert [f.turn for f in findings] == [1] and rejected == 0  # the half line is not read at all
