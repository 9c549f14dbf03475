"""What the learner's built-in datasets and the reward server's built-in environments must agree on,
kept in one place: the calculator task's prompt wording and its `add` tool (the dataset renders the
tool into SFT demonstrations; the environment offers and executes it)."""

from __future__ import annotations

from typing import Any

ADD_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers and return their sum.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "The first addend."},
                "b": {"type": "integer", "description": "The second addend."},
            },
            "required": ["a", "b"],
        },
    },
}


def calculator_prompt(a: int, b: int) -> str:
    return f"What is {a} + {b}? Use the add tool, then answer with the number only."
