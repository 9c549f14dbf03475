"""Tool calls in the model's text (Hermes format) become OpenAI tool calls, and an agent's messages
compare equal to the ones the endpoint returned whatever ids its client gave the calls."""

import json

from rlmesh.rollout_server.chat_messages import Message, parse_tool_calls, same_message, template_message


def test_hermes_blocks_become_tool_calls_and_the_rest_stays_content():
    text = ('Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["lookup", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[1]["function"]["arguments"] == '{"a": 1}'
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_a_block_that_is_not_a_call_is_kept_as_text():
    for text in ("<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "plain answer"):
        assert parse_tool_calls(text) == (text, [])


def test_a_returned_assistant_message_compares_equal_whatever_the_call_ids():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 2}}</tool_call>')
    kept = template_message(Message(role="assistant", content="", tool_calls=calls))
    echoed = dict(calls[0], id="call_client_side")
    sent = template_message(Message.model_validate({"role": "assistant", "content": None, "tool_calls": [echoed]}))
    assert same_message(sent, kept)
    other = dict(echoed, function={"name": "f", "arguments": '{"x": 3}'})
    assert not same_message(template_message(Message.model_validate({"role": "assistant", "tool_calls": [other]})), kept)
    parts = Message.model_validate({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    assert template_message(parts)["content"] == "ab"


def test_a_reply_repeated_without_its_surrounding_whitespace_is_the_same_message():
    """smolagents strips what the model said before sending it back: the conversation is unchanged (the
    context keeps the sampled ids); any other change to the text is an edit."""
    kept = template_message(Message(role="assistant", content=" 579\n"))
    assert same_message(template_message(Message(role="assistant", content=[{"type": "text", "text": "579"}])), kept)
    assert not same_message(template_message(Message(role="assistant", content="57 9")), kept)
    user = template_message(Message(role="user", content="hi"))
    assert not same_message(user, template_message(Message(role="user", content=" hi")))


def test_calls_repeated_as_smolagents_text_are_the_calls_returned():
    """smolagents repeats a reply's calls as `Calling tools:` and a Python list in the assistant's text,
    after what the model said: the same calls (whatever their ids); other calls or other text are an edit."""
    _, calls = parse_tool_calls('Let me look. <tool_call>{"name": "lookup", "arguments": {"a": 579}}</tool_call>')
    kept = template_message(Message(role="assistant", content="Let me look.", tool_calls=calls))

    def repeated(text: str, a: int = 579) -> dict:
        replay = [{"id": "call_7", "type": "function", "function": {"name": "lookup", "arguments": {"a": a}}}]
        said = {"type": "text", "text": f"{text}\nCalling tools:\n{replay}"}
        return template_message(Message(role="assistant", content=[said]))

    assert same_message(repeated("Let me look."), kept)
    assert not same_message(repeated("Let me look."), template_message(Message(role="assistant", content="Let me look.")))
    assert not same_message(repeated("Let me look.", a=580), kept)
    assert not same_message(repeated("Let me see."), kept)
    not_calls = template_message(Message(role="assistant", content="Let me look.\nCalling tools:\n[{'id': 1}]"))
    assert not same_message(not_calls, kept)
