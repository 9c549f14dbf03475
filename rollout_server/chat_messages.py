"""The chat-completions request as OpenAI's API defines the parts rlmesh reads, and the conversions the
agent endpoint makes: a message as chat templates read it, whether a repeated message is the one kept
(the history check), and Hermes-format tool calls parsed out of a completion's text."""

from __future__ import annotations

import ast
import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# smolagents sends the calls a reply made back as text in the assistant's content (its memory's form).
_REPLAYED_CALLS = re.compile(r"(?:^|\n)Calling tools:\n(\[.*\])\s*$", re.DOTALL)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields rlmesh does not use (stream_options, ...)


class FunctionCall(_Open):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=1 << 20)


class ToolCall(_Open):
    id: str = Field("", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Open):
    type: Literal["text"]
    text: str


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, max_length=256)


class ChatRequest(_Open):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    logprobs: bool = False


def _content(m: Message) -> str:
    if isinstance(m.content, list):
        return "".join(part.text for part in m.content)
    return m.content or ""


def arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_message(m: Message) -> dict[str, Any]:
    """The message as chat templates read it (tool-call arguments as objects), and as the history
    check compares it: tool-call ids are the client's business and do not count."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _content(m)}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                               "arguments": arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def same_message(sent: dict[str, Any], kept: dict[str, Any]) -> bool:
    """Whether a message the agent repeats is the one kept. The context keeps the ids sampled whatever
    form the agent repeats them in, so a reply is the same when only its form differs: stripped of the
    whitespace around it (smolagents strips every reply), or its tool calls given as smolagents' text
    instead of `tool_calls`."""
    if kept.get("tool_calls") and not sent.get("tool_calls"):
        sent = _replayed_calls(sent)

    def compared(m: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in m.items() if k != "tool_call_id"}
        if out["role"] == "assistant":
            out["content"] = out["content"].strip()
        return out
    return compared(sent) == compared(kept)


def _replayed_calls(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose content ends as smolagents repeats a reply's calls, `Calling tools:` and
    a Python list of `{"id", "type", "function": {"name", "arguments"}}`, with those calls as `tool_calls`."""
    match = _REPLAYED_CALLS.search(m["content"]) if m["role"] == "assistant" else None
    if match is None:
        return m
    try:
        calls = [{"type": "function", "function": {"name": c["function"]["name"],
                                                   "arguments": c["function"]["arguments"]}}
                 for c in ast.literal_eval(match.group(1))]
    except (ValueError, SyntaxError, TypeError, KeyError):  # not that form: compared as the text it is
        return m
    return {**m, "content": m["content"][:match.start()], "tool_calls": calls}


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool calls in the OpenAI schema) of a completion in the Hermes format; a block that
    is not a JSON object with a name stays in the content, so nothing the model said is lost."""
    calls, kept = [], []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls
