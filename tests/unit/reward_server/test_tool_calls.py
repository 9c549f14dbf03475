import pytest

from rlmesh.reward_server.environments.tool_calls import (MalformedToolCall, ToolCall, format_tool_call, has_tool_call,
                                                   parse_tool_calls)


def test_parses_qwen_hermes_blocks_in_order():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 123, "b": 456}}\n</tool_call>\n'
            '<tool_call>{"name": "mul", "arguments": {"x": 1}}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 123, "b": 456}), ToolCall("mul", {"x": 1})]


def test_format_round_trips():
    text = format_tool_call("add", {"a": 1, "b": 2})
    assert has_tool_call(text)
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2})]


def test_plain_text_has_no_calls():
    assert not has_tool_call("The answer is 579.")
    assert parse_tool_calls("The answer is 579.") == []


def test_arguments_encoded_as_a_json_string_are_accepted():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2})]


def test_missing_arguments_mean_no_arguments():
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{name: add}</tool_call>", "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "JSON object, got list"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', '"arguments" of \'add\''),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}', "never closed"),
    ('{"name": "add"}</tool_call>', "without a <tool_call>"),
])
def test_malformed_calls_say_what_is_wrong(text, error):
    calls = parse_tool_calls(text)
    assert len(calls) == 1 and isinstance(calls[0], MalformedToolCall)
    assert error in calls[0].error
    assert has_tool_call(text)


def test_a_bad_call_does_not_hide_a_good_one():
    text = '<tool_call>oops</tool_call> <tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    bad, good = parse_tool_calls(text)
    assert isinstance(bad, MalformedToolCall) and good == ToolCall("add", {"a": 1, "b": 1})
