"""Grounded tool-call validity (issue 15): only real, tagged, task-referring calls that ran count as valid."""

from __future__ import annotations

import json

import pytest

from shipyard.harness.loop import Agent, LoopConfig
from shipyard.harness.trajectory import CallRecord
from shipyard.harness.validity import NOT_GROUNDED, ValidityChecker, ValidityStats, trajectory_validity, words
from shipyard.models.replay import ReplayEngine

CHECK = ValidityChecker()


def ran(name, **args):
    return CallRecord(0, name, args, "ok", None, 0.01)


def tagged(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>\n'


PLACEHOLDERS = [
    ("run_terminal", {"command": "the bash command line to run"}),  # the measured failure, verbatim
    ("run_terminal", {"command": "The bash command line to run."}),  # the description exactly
    ("run_terminal", {"command": "  THE  bash\tcommand line\nto RUN  "}),  # whitespace and case differ
    ("run_terminal", {"command": "bash command line"}),  # three consecutive words of it
    ("run_terminal", {"command": "Run a bash command in the workspace."}),  # the tool's description
    ("run_terminal", {"command": "command"}),  # the key echoed
    ("run_terminal", {"command": "<command>"}),  # a template slot
    ("run_terminal", {"command": "cat /path/to/file.py"}),  # the documentation path
    ("read_file", {"path": "File path relative to the workspace root."}),
    ("read_file", {"path": "path"}),
    ("read_file", {"path": "{path}"}),
    ("write_file", {"path": "path/to/file.py", "content": "print(1)\n"}),
    ("write_file", {"path": "notes.md", "content": "The complete new file contents."}),
    ("grep", {"pattern": "Regular expression to search for"}),
    ("grep", {"pattern": "string"}),  # a JSON-Schema type name
    ("search_replace", {"path": "a.py", "old_string": "Exact text to replace", "new_string": "x"}),
    ("read_lints", {"paths": ["<args-json-object>"]}),
    ("todo_write", {"todos": [{"id": "1", "content": "<content>", "status": "pending"}]}),
]


@pytest.mark.parametrize("name,args", PLACEHOLDERS)
def test_placeholder_copies_are_flagged_and_not_grounded(name, args):
    verdict = CHECK.call(ran(name, **args))
    assert not verdict.grounded and verdict.problem == "placeholder" and verdict.placeholders


GROUNDED = [
    ("run_terminal", {"command": "bash run_tests.sh"}),  # shares 'bash' and 'run' with the description
    ("run_terminal", {"command": "python -m pytest -q tests/test_roman.py"}),
    ("run_terminal", {"command": "echo line to be run > log.txt && bash -c 'run'"}),  # words, but not in a run
    ("run_terminal", {"command": "git diff --stat", "timeout": 30}),
    ("glob", {"pattern": "**/*.py"}),  # the example the description gives is a fine argument
    ("grep", {"pattern": "def to_roman", "glob": "*.py"}),
    ("grep", {"pattern": "<div>"}),  # an HTML tag is not a template slot
    ("list_dir", {"path": "."}),
    ("list_dir", {}),
    ("read_file", {"path": "pocketlib/roman.py", "offset": 3}),
    ("write_file", {"path": "pocketlib/__init__.py", "content": ""}),  # an empty new file is an answer
    ("search_replace", {"path": "a.py", "old_string": "x = 1\n", "new_string": ""}),  # a deletion
    ("todo_write", {"todos": [{"id": "1", "content": "fix to_roman for 4", "status": "in_progress"}]}),
]


@pytest.mark.parametrize("name,args", GROUNDED)
def test_real_calls_are_grounded(name, args):
    verdict = CHECK.call(ran(name, **args))
    assert verdict.grounded and verdict.problem is None and verdict.placeholders == ()


@pytest.mark.parametrize("name,args", [("run_terminal", {"command": "..."}), ("run_terminal", {"command": "TODO"}),
                                       ("grep", {"pattern": "   "}), ("write_file", {"path": "a.py", "content": "…"})])
def test_trivial_arguments_are_not_grounded(name, args):
    verdict = CHECK.call(ran(name, **args))
    assert not verdict.grounded and verdict.problem == "trivial" and verdict.placeholders == ()


def test_every_failure_is_not_grounded_with_its_kind():
    for kind in ("untagged", "truncated", "malformed", "unknown_tool", "bad_arguments", "tool_error"):
        record = CallRecord(0, "read_file", {"path": "a.py"}, "error: x", "x", 0.0, error_kind=kind)
        assert CHECK.call(record) == CHECK.call(record) and CHECK.call(record).problem == kind
    legacy = CallRecord(0, None, None, "error: x", "x", 0.0)  # written before error kinds existed
    assert CHECK.call(legacy).problem == "unclassified"
    accepted = CallRecord(0, "read_file", {"path": "a.py"}, "1\tx", None, 0.0, untagged=True)
    assert CHECK.call(accepted).problem == "untagged_ran"  # grounded but for its format
    copied = CallRecord(0, "read_file", {"path": "File path relative to the workspace root."}, "x", None, 0.0,
                        untagged=True)
    assert CHECK.call(copied).problem == "placeholder"  # the format is checked last: a worse problem names it
    other_tools = CallRecord(0, "web_search", {"query": "roman"}, "…", None, 0.0)
    assert CHECK.call(other_tools).problem == "unknown_tool"
    assert {"placeholder", "trivial", "no_target", "unclassified"} <= set(NOT_GROUNDED)


def test_a_placeholder_is_counted_even_when_the_call_failed():
    record = CallRecord(0, "read_file", {"path": "File path relative to the workspace root."}, "error: missing",
                        "missing", 0.0, error_kind="tool_error")
    verdict = CHECK.call(record)
    assert verdict.problem == "tool_error" and verdict.placeholders == ("path",)


def test_words_normalise_case_whitespace_and_punctuation():
    assert words("  The\tBASH command-line, to_run. ") == ("the", "bash", "command", "line", "to", "run")


def test_a_real_episode_read_missing_vs_write_creating(workspace):
    """Real tools in a real workspace: a path that does not exist fails for read_file (not grounded) while write_file
    creates it (grounded); the placeholder command runs without error yet is flagged."""
    script = [
        tagged("read_file", path="pocketlib/not_there.py") + tagged("write_file", path="pocketlib/not_there.py",
                                                                     content="X = 1\n"),
        tagged("read_file", path="pocketlib/not_there.py") + tagged("run_terminal",
                                                                    command="the bash command line to run"),
        tagged("read_lints", paths=["does/not/exist.py"]) + tagged("run_terminal", command="ls pocketlib")
        + '{"name": "list_dir", "arguments": {"path": "."}}',
        "Done.",
    ]
    traj = Agent(ReplayEngine(script), workspace, LoopConfig(untagged_calls="reject")).run("x")
    assert traj.stop_reason == "finished"
    verdicts = [CHECK.call(c) for t in traj.turns for c in t.calls]
    assert [(v.grounded, v.problem) for v in verdicts] == [
        (False, "tool_error"), (True, None),  # read before it exists; written
        (True, None), (False, "placeholder"),  # read after; the placeholder ran (bash: 'the': command not found)
        (False, "no_target"), (True, None),  # read_lints says nothing to lint; a real command
    ]
    stats = trajectory_validity(traj)
    assert (stats.calls, stats.grounded, stats.placeholder, stats.untagged) == (6, 3, 1, 0)
    assert stats.problems == {"tool_error": 1, "placeholder": 1, "no_target": 1}
    assert stats.grounded_fraction == pytest.approx(3 / 6)


def test_untagged_calls_are_counted_and_never_grounded(workspace):
    bare = '{"name": "list_dir", "arguments": {"path": "."}}'
    for setting, problem in (("reject", "untagged"), ("accept", "untagged_ran")):
        traj = Agent(ReplayEngine([bare, "Done."]), workspace, LoopConfig(untagged_calls=setting)).run("x")
        stats = trajectory_validity(traj)
        assert (stats.calls, stats.grounded, stats.untagged, stats.problems) == (1, 0, 1, {problem: 1})


def test_stats_add_up_and_flatten():
    a = ValidityStats(4, 2, 1, 0, {"placeholder": 1, "tool_error": 1})
    b = ValidityStats(2, 1, 0, 1, {"untagged": 1})
    total = a + b
    assert (total.calls, total.grounded, total.placeholder, total.untagged) == (6, 3, 1, 1)
    assert total.problems == {"placeholder": 1, "tool_error": 1, "untagged": 1}
    assert total.as_metrics() == {"validity_calls": 6, "validity_grounded": 3, "validity_placeholder": 1,
                                  "validity_untagged": 1, "validity_grounded_fraction": 0.5,
                                  "validity_not_grounded_placeholder": 1, "validity_not_grounded_tool_error": 1,
                                  "validity_not_grounded_untagged": 1}
    assert ValidityStats().grounded_fraction == 0.0


@pytest.mark.parametrize("command", ["echo the bash command line to run", "the bash command line to run now",
                                     "File path relative to the workspace root.", "<command_to_run>"])
def test_edited_copies_of_a_description_are_placeholders(command):
    """Review finding: one added word, another tool's description or a slot naming the key slipped the check."""
    record = CallRecord(0, "run_terminal", {"command": command}, "[exit code 127]", None, 0.0)
    assert CHECK.call(record).placeholders == ("command",)


@pytest.mark.parametrize("command", ["python -m pytest -q tests/test_stats.py", "grep -rn median pocketlib",
                                     "cat pocketlib/stats.py", "git diff"])
def test_real_commands_are_not_placeholders(command):
    record = CallRecord(0, "run_terminal", {"command": command}, "ok\n[exit code 0]", None, 0.0)
    assert CHECK.call(record).grounded


@pytest.mark.parametrize("output", ["bash: asdf: command not found\n[exit code 127]",
                                    "[timed out after 5 s; the command's process group was killed. Use a longer "
                                    "`timeout`, or `background: true` for servers and watchers]"])
def test_a_command_that_did_not_run_is_not_grounded(output):
    record = CallRecord(0, "run_terminal", {"command": "asdf"}, output, None, 0.0)
    assert CHECK.call(record).problem == "not_run"
    failing_tests = CallRecord(0, "run_terminal", {"command": "python -m pytest"}, "1 failed\n[exit code 1]", None, 0)
    assert CHECK.call(failing_tests).grounded  # a failing test run is an outcome of the task


def test_a_placeholder_is_counted_when_the_call_did_not_run():
    """Review finding: a placeholder call that also broke the schema, or that was written untagged under "reject",
    lost its arguments in parsing, so the placeholder went uncounted — breaking the call hid it."""
    from shipyard.harness.parse import ToolCallParser
    from shipyard.harness.tools import default_tools

    copied = '{"name": "run_terminal", "arguments": {"command": "the bash command line to run"%s}}'
    schema_broken = "<tool_call>" + copied % ', "timeout": "9"' + "</tool_call>"
    for setting, text in (("accept", schema_broken), ("reject", copied % "")):
        (call,) = ToolCallParser(default_tools(), setting).parse(text).calls
        assert call.error is not None and call.arguments["command"] == "the bash command line to run"
        record = CallRecord(0, call.name, call.arguments, "error", call.error, 0.0, error_kind=call.error_kind)
        assert CHECK.call(record).placeholders == ("command",) and not CHECK.call(record).grounded
