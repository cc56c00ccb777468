import json

from hypothesis import given, settings
from hypothesis import strategies as st

from shipyard.harness.parse import ToolCallParser
from shipyard.harness.tools import default_tools

PARSER = ToolCallParser(default_tools())
LENIENT = ToolCallParser(default_tools(), "accept")


def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_single_json_call():
    turn = PARSER.parse("Let me look.\n" + call("read_file", path="a.py", offset=3))
    assert turn.content == "Let me look."
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("read_file", {"path": "a.py", "offset": 3}, None)]
    assert not turn.is_final


def test_parallel_calls_keep_order():
    turn = PARSER.parse(call("read_file", path="a.py") + call("grep", pattern="x") + call("list_dir"))
    assert [c.name for c in turn.calls] == ["read_file", "grep", "list_dir"]
    assert [c.index for c in turn.calls] == [0, 1, 2]


def test_arguments_as_json_string():
    text = '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"a.py\\"}"}</tool_call>'
    assert PARSER.parse(text).calls[0].arguments == {"path": "a.py"}


def test_xml_form_raw_values_and_coercion():
    code = 'def f():\n    return "<b>" & 1\n'
    text = (f"<tool_call>\n<function=write_file>\n<parameter=path>\nx.py\n</parameter>\n<parameter=content>\n{code}\n"
            "</parameter>\n</function>\n</tool_call>"
            "<tool_call><function=read_file><parameter=path>x.py</parameter><parameter=limit>5</parameter>"
            "</function></tool_call>")
    calls = PARSER.parse(text).calls
    assert calls[0].error is None and calls[0].arguments == {"path": "x.py", "content": code}
    assert calls[1].error is None and calls[1].arguments == {"path": "x.py", "limit": 5}


def test_xml_array_parameter():
    text = '<tool_call><function=read_lints><parameter=paths>["a.py", "b"]</parameter></function></tool_call>'
    assert PARSER.parse(text).calls[0].arguments == {"paths": ["a.py", "b"]}


def test_no_calls_is_final():
    turn = PARSER.parse("All done: the tests pass.")
    assert turn.is_final and turn.calls == []


def test_unknown_tool_lists_valid_tools():
    err = PARSER.parse(call("open_file", path="a")).calls[0].error
    assert "tool call #1" in err and "unknown tool 'open_file'" in err
    assert "read_file" in err and "run_terminal" in err


def test_missing_extra_and_mistyped_arguments():
    err = PARSER.parse(call("read_file", offset="3")).calls[0].error
    assert "'path' is a required property" in err and "'3' is not of type 'integer'" in err
    assert "read_file(path: string, offset?: integer, limit?: integer)" in err
    err = PARSER.parse(call("read_file", path="a", colour="red")).calls[0].error
    assert "'colour' was unexpected" in err


def test_malformed_json_reports_position():
    err = PARSER.parse('<tool_call>{"name": "read_file", "arguments": {"path": }</tool_call>').calls[0].error
    assert "invalid JSON" in err and "column" in err


def test_unclosed_and_stray_tags():
    turn = PARSER.parse(call("list_dir") + '<tool_call>{"name": "grep", "argum')
    assert turn.calls[0].error is None
    assert "not closed" in turn.calls[1].error
    turn = PARSER.parse("oops </tool_call> " + call("list_dir"))
    assert "without a matching" in turn.calls[0].error and turn.calls[1].error is None


def test_unclosed_followed_by_another_call():
    turn = PARSER.parse('<tool_call>{"name": "x"' + call("list_dir"))
    assert "not closed" in turn.calls[0].error
    assert turn.calls[1].name == "list_dir" and turn.calls[1].error is None


def test_body_in_neither_form():
    err = PARSER.parse("<tool_call>read_file a.py</tool_call>").calls[0].error
    assert "JSON object" in err and "<function=NAME>" in err


def test_bad_top_level_shapes():
    assert "must be a JSON object" in PARSER.parse("<tool_call>[1, 2]</tool_call>").calls[0].error
    assert "unexpected keys" in PARSER.parse('<tool_call>{"name": "list_dir", "args": {}}</tool_call>').calls[0].error
    assert "after the JSON" in PARSER.parse('<tool_call>{"name": "list_dir"} extra</tool_call>').calls[0].error
    assert "non-empty string" in PARSER.parse('<tool_call>{"name": 5}</tool_call>').calls[0].error


def test_xml_errors():
    assert "not closed with </function>" in PARSER.parse(
        "<tool_call><function=list_dir><parameter=path>.</parameter></tool_call>").calls[0].error
    assert "given twice" in PARSER.parse(
        "<tool_call><function=list_dir><parameter=path>.</parameter><parameter=path>b</parameter></function>"
        "</tool_call>").calls[0].error
    assert "unexpected text" in PARSER.parse(
        "<tool_call><function=list_dir>hello</function></tool_call>").calls[0].error


def test_untagged_calls_rejected_by_default_accepted_when_asked():
    bare = '{"name": "read_file", "arguments": {"path": "a.py"}}'
    fenced = f"```json\n{bare}\n```"
    for text in (bare, fenced, "<function=list_dir></function>"):
        strict = PARSER.parse(text)
        assert not strict.is_final and "not wrapped in <tool_call>" in strict.calls[0].error
        lenient = LENIENT.parse(text)
        assert lenient.calls[0].error is None and lenient.calls[0].untagged
    # JSON that does not name a tool is just text in a final answer.
    assert PARSER.parse('The config is {"name": "demo"}.').is_final


FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=", "<function=read_file>", "</function>", "<parameter=path>",
             "</parameter>", "{", "}", '"name"', '"arguments"', ":", ",", '"read_file"', "\n", "```json", "[", "]"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=30))
def test_never_raises_on_random_output(parts):
    for parser in (PARSER, LENIENT):
        turn = parser.parse("".join(parts))
        for c in turn.calls:
            if c.error is None:
                assert c.name in parser.tools and isinstance(c.arguments, dict)
            else:
                assert c.error.startswith("tool call #")


VALID = ("I will read both.\n" + call("read_file", path="pocketlib/roman.py") +
         "\n<tool_call>\n<function=grep>\n<parameter=pattern>\ndef to_roman\n</parameter>\n</function>\n</tool_call>")


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=len(VALID)))
def test_truncated_output_never_raises_and_reports(cut):
    turn = PARSER.parse(VALID[:cut])
    opened = VALID[:cut].count("<tool_call>")
    # Every opened block is accounted for as a call: complete ones valid, cut ones with an error.
    assert len(turn.calls) >= opened
    for c in turn.calls:
        assert c.error is None or c.error.startswith("tool call #")
