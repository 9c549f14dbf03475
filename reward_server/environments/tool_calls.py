"""Tool calls in the Qwen / Hermes chat format: the model writes

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

one block per call, anywhere in its assistant message. `parse_tool_calls` finds every block and
returns a `ToolCall` or, for a block it cannot read, a `MalformedToolCall` saying what is wrong, so
that an environment can show the model its mistake instead of failing the episode.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class MalformedToolCall:
    text: str
    error: str


def has_tool_call(text: str) -> bool:
    """Whether the message tries to call a tool at all (well-formed or not)."""
    return OPEN in text or CLOSE in text


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One call in the format `parse_tool_calls` reads (what Qwen2.5's chat template renders)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


def parse_tool_calls(text: str) -> list[ToolCall | MalformedToolCall]:
    """Every tool-call block in `text`, in order; an unclosed or stray tag is one malformed call."""
    calls: list[ToolCall | MalformedToolCall] = [_parse_block(m.group(1)) for m in _BLOCK.finditer(text)]
    rest = _BLOCK.sub("", text)
    if OPEN in rest:
        tail = rest[rest.index(OPEN):]
        calls.append(MalformedToolCall(tail, f"{OPEN} is never closed; end each call with {CLOSE}"))
    elif CLOSE in rest:
        calls.append(MalformedToolCall(rest, f"{CLOSE} without a {OPEN} before it"))
    return calls


def _parse_block(body: str) -> ToolCall | MalformedToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return MalformedToolCall(body, f"the tool call is not valid JSON ({err.msg} at char {err.pos}); "
                                       'write {"name": ..., "arguments": {...}}')
    if not isinstance(call, dict):
        return MalformedToolCall(body, f"the tool call must be a JSON object, got {type(call).__name__}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return MalformedToolCall(body, 'the tool call has no "name" (a non-empty string)')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models encode the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return MalformedToolCall(body, f'"arguments" of {name!r} must be a JSON object, got {arguments!r}')
    return ToolCall(name, arguments)
