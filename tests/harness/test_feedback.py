"""Failed calls get feedback and the episode goes on; prose without a call still ends it (issue 15, deliverable 2).

Before this change an attempted call that the parser did not recognise as one (bare JSON naming an unknown tool,
a call wrapped in another object, single-quoted or cut-off bare JSON, a `<tool_call>` tag cut mid-way) ended the
episode as the model's final answer, with no feedback.
"""

from __future__ import annotations

import json

import pytest

from shipyard.harness.loop import Agent, LoopConfig
from shipyard.harness.parse import ToolCallParser
from shipyard.harness.tools import default_tools
from shipyard.harness.trajectory import ERROR_KINDS, Trajectory
from shipyard.models.replay import ReplayEngine

STRICT = ToolCallParser(default_tools())
LENIENT = ToolCallParser(default_tools(), "accept")
EXAMPLE = '{"name": "list_dir", "arguments": {"path": "."}}'


def tagged(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>\n'


def bare(name, **args):
    return json.dumps({"name": name, "arguments": args})


# Each failure kind, as the strict parser (the default) and the lenient one see it: (text, strict kind, lenient kind)
FAILURES = {
    "tagged unknown tool": (tagged("open_file", path="a.py"), "unknown_tool", "unknown_tool"),
    "tagged invalid json": ('<tool_call>{"name": "read_file", "arguments": {"path": }}</tool_call>', "malformed",
                            "malformed"),
    "tagged cut off": ('I will read it.\n<tool_call>\n{"name": "read_file", "argu', "truncated", "truncated"),
    "tag itself cut off": ("I will read it.\n<tool_c", "truncated", "truncated"),
    "tagged bad arguments": (tagged("read_file", offset="3"), "bad_arguments", "bad_arguments"),
    "bare unknown tool": (bare("open_file", path="a.py"), "untagged", "unknown_tool"),
    "fenced unknown tool": (f"Let me open it.\n```json\n{bare('open_file', path='a.py')}\n```", "untagged",
                            "unknown_tool"),
    "bare known tool": (bare("read_file", path="a.py"), "untagged", None),
    "bare function block, unknown": ("<function=open_file><parameter=path>a.py</parameter></function>", "untagged",
                                     "unknown_tool"),
    "bare json cut off": ('{"name": "write_file", "arguments": {"path": "a.py", "content": "def f():\\n  ret',
                          "untagged", "truncated"),
    "fenced json cut off": ('```json\n{"name": "read_file", "arguments": {"path": "a.p', "untagged", "truncated"),
    "single-quoted bare call": ("{'name': 'read_file', 'arguments': {'path': 'a.py'}}", "untagged", "malformed"),
    "broken bare json": ('```json\n{"name": "grep", "arguments": {"pattern": "def "}\n```\nThen I will fix it.',
                         "untagged", "malformed"),
    "call wrapped in an OpenAI object": (json.dumps({"type": "function", "function": {
        "name": "read_file", "arguments": {"path": "a.py"}}}), "untagged", None),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_every_attempted_call_is_a_call_with_its_error_kind(case):
    text, strict_kind, lenient_kind = FAILURES[case]
    for parser, kind in ((STRICT, strict_kind), (LENIENT, lenient_kind)):
        turn = parser.parse(text)
        assert not turn.is_final, (case, parser.untagged)
        assert [c.error_kind for c in turn.calls] == [kind], (case, parser.untagged)
        if kind is not None:
            assert turn.calls[0].error.startswith("tool call #1")
        if kind is None:  # accepted untagged: runs, and is marked
            assert turn.calls[0].untagged and turn.calls[0].name == "read_file"


@pytest.mark.parametrize("case", [c for c, (_, kind, _) in FAILURES.items() if kind != "bad_arguments"])
def test_a_format_error_says_what_was_wrong_and_shows_the_format_and_the_tools(case):
    error = STRICT.parse(FAILURES[case][0]).calls[0].error
    assert EXAMPLE in error and "<tool_call>" in error and "</tool_call>" in error
    for tool in ("read_file", "run_terminal", "todo_write"):
        assert tool in error


def test_the_format_help_is_given_once_per_turn():
    turn = STRICT.parse(tagged("nope") + tagged("nada") + tagged("list_dir"))
    assert [c.error_kind for c in turn.calls] == ["unknown_tool", "unknown_tool", None]
    assert EXAMPLE in turn.calls[0].error and EXAMPLE not in turn.calls[1].error
    assert "read_file" in turn.calls[1].error  # an unknown tool always lists the tools


def test_untagged_rejection_also_names_the_other_problem():
    error = STRICT.parse(bare("open_file", path="a.py")).calls[0].error
    assert "not wrapped in <tool_call>" in error and "unknown tool 'open_file'" in error


PROSE = [
    "All done: the tests pass.",
    'The config is {"name": "demo"}.',
    'Set `{"name": "demo", "arguments": {}}` in the manifest and you are done.',
    'I changed the payload:\n```python\npayload = {"name": "demo", "arguments": {"x": 1}}\n```\nTests pass.',
    'The fixture now returns\n```json\n[{"name": "alice", "arguments": [1, 2]},\n {"name": "bob"}]\n```',
    "I used read_file and run_terminal to check; `to_roman(4)` returns 'IV'. The set {1, 2, 3} is fine.",
    "Fixed `f'{name}: {value}'` formatting and the dict {'a': 1}. Done.",
    '{"status": "ok", "files_changed": 1}',
    "The regex `\\{\\s*\"name\"` was wrong; fixed.",
    "Summary:\n- `def run(self) -> dict: return {\"name\": self.name}`\n- tests pass",
    "I looked at the <table> element and the <tool> docs.",
    "x = {\n  'name': obj.name,\n  'arguments': obj.args,\n}",
]


@pytest.mark.parametrize("text", PROSE)
def test_prose_with_braces_and_code_is_still_a_final_answer(text):
    for parser in (STRICT, LENIENT):
        turn = parser.parse(text)
        assert turn.is_final and turn.calls == [], text


def test_executor_records_tool_errors_and_kinds(workspace):
    traj = Agent(ReplayEngine([tagged("read_file", path="missing.py") + tagged("list_dir"), "done"]),
                 workspace).run("x")
    first = traj.turns[0].calls
    assert [c.error_kind for c in first] == ["tool_error", None]
    assert "missing.py" in first[0].error


@pytest.mark.parametrize("case", list(FAILURES))
def test_the_episode_goes_on_after_a_failed_call(case, workspace):
    text, kind, _ = FAILURES[case]
    script = [text, tagged("list_dir"), "Done."]
    traj = Agent(ReplayEngine(script), workspace, LoopConfig(untagged_calls="reject")).run("x")
    assert traj.stop_reason == "finished" and len(traj.turns) == 3, case
    failed = traj.turns[0].calls[0]
    assert failed.error_kind == kind and failed.output == f"error: {failed.error}"
    assert traj.turns[0].observation_ids  # the model was answered
    decoded = ReplayEngine(["x"]).tokenizer.decode(traj.turns[0].observation_ids)
    assert "<tool_response>" in decoded and failed.error in decoded
    assert ("list_dir" if kind != "bad_arguments" else "read_file(path: string") in decoded
    assert traj.turns[1].calls[0].error is None


def test_a_call_cut_by_max_new_tokens_is_reported_as_truncated_and_the_episode_goes_on(workspace):
    long_call = tagged("write_file", path="notes.txt", content="x" * 400)
    traj = Agent(ReplayEngine([long_call, tagged("list_dir"), "Done."]), workspace,
                 LoopConfig(max_new_tokens=120)).run("x")
    assert traj.turns[0].finish_reason == "length"
    call = traj.turns[0].calls[0]
    assert call.error_kind == "truncated" and "max_new_tokens" in call.error and "120" in call.error
    assert traj.stop_reason == "finished" and len(traj.turns) == 3
    assert not (workspace.root / "notes.txt").exists()


def test_consecutive_failed_turns_are_still_bounded(workspace):
    script = [bare("open_file", path="a.py")] * 2 + ["{'name': 'read_file'"] + ["<tool_c"] * 5
    traj = Agent(ReplayEngine(script), workspace, LoopConfig(max_failed_turns=4)).run("x")
    assert traj.stop_reason == "repeated_failures" and len(traj.turns) == 4
    assert [t.calls[0].error_kind for t in traj.turns] == ["untagged", "untagged", "untagged", "truncated"]


def test_prose_turn_still_ends_the_episode(workspace):
    traj = Agent(ReplayEngine([PROSE[3], tagged("list_dir")]), workspace).run("x")
    assert traj.stop_reason == "finished" and len(traj.turns) == 1 and traj.turns[0].calls == []


def test_trajectories_saved_before_error_kind_still_load(workspace, tmp_path):
    traj = Agent(ReplayEngine([tagged("nope"), tagged("list_dir"), "Done."]), workspace).run("x")
    data = traj.to_dict()
    for t in data["turns"]:
        for c in t["calls"]:
            del c["error_kind"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = Trajectory.load(path)
    assert old.turns[0].calls[0].error == traj.turns[0].calls[0].error and old.turns[0].calls[0].error_kind is None
    assert old.turns[0].calls[0].error.startswith("tool call #1 (nope): unknown tool 'nope'. Available tools: ")
    assert old.token_ids() == traj.token_ids()
    assert Trajectory.from_dict(traj.to_dict()).turns[0].calls[0].error_kind == "unknown_tool"


def test_error_kinds_are_a_closed_vocabulary():
    assert set(ERROR_KINDS) == {"untagged", "truncated", "malformed", "unknown_tool", "bad_arguments", "rejected_edit",
                                "tool_error"}
    seen = {k for text, s, lenient in FAILURES.values() for k in (s, lenient)} - {None}
    assert seen <= set(ERROR_KINDS)


def test_a_call_after_a_long_json_document_is_still_found():
    doc = json.dumps({"rows": [{"id": i, "tags": {"a": i}} for i in range(600)]})  # 1200 objects: > the try budget
    turn = STRICT.parse(f"Here is the data:\n{doc}\n" + bare("read_file", path="a.py"))
    assert [c.error_kind for c in turn.calls] == ["untagged"]
    assert LENIENT.parse(f"{doc}\n" + bare("read_file", path="a.py")).calls[0].arguments == {"path": "a.py"}
