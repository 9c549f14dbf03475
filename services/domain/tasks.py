"""What the learner's built-in datasets and the reward server's built-in environments must agree on,
kept in one place: the calculator task's prompt wording and its `add` tool (the dataset renders the
tool into SFT demonstrations; the environment offers and executes it), and how a reasoning-gym entry
travels in an example's metadata."""

from __future__ import annotations

import json
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


def reasoning_gym_metadata(dataset: str, entry: dict[str, Any]) -> dict[str, Any]:
    """A reasoning-gym entry as env_metadata: the dataset's name, its answer (also the SFT reference),
    and the whole entry as JSON text. Text, because env_metadata is a protobuf Struct, which would turn
    the entry's integers into floats (and a scorer that formats one would then read `3.0`)."""
    return {"dataset": dataset, "answer": entry["answer"],
            "entry": json.dumps({"question": entry["question"], "answer": entry["answer"],
                                 "metadata": entry["metadata"]})}


def read_reasoning_gym_metadata(metadata: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(dataset name, entry) from env_metadata as `reasoning_gym_metadata` writes it; ValueError saying
    what is missing or malformed (any caller may send any metadata)."""
    dataset, text = metadata.get("dataset"), metadata.get("entry")
    if not isinstance(dataset, str) or not dataset:
        raise ValueError(f"metadata.dataset must name a reasoning-gym dataset, got {dataset!r:.80}")
    if not isinstance(text, str):
        raise ValueError("metadata.entry must be the reasoning-gym entry as JSON text "
                         f"({{question, answer, metadata}}), got {type(text).__name__}")
    try:
        entry = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:  # RecursionError: nested past Python's limit
        raise ValueError(f"metadata.entry is not JSON ({type(err).__name__}: {str(err)[:120]})") from None
    if not (isinstance(entry, dict) and isinstance(entry.get("answer"), (str, type(None)))
            and isinstance(entry.get("metadata"), dict) and isinstance(entry.get("question", ""), str)):
        raise ValueError("metadata.entry must be a JSON object with an 'answer' (text or null), a 'metadata' object "
                         "and optionally a 'question' (text)")
    entry.setdefault("question", "")
    return dataset, entry
