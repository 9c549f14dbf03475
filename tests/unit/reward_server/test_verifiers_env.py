"""The verifiers adapter's own conversions, without verifiers (tests/integration/test_verifiers.py runs
it with verifiers in its virtualenv): messages both ways, the row an item's metadata makes, rewards
that are not numbers, and hosting where verifiers is not installed."""

from __future__ import annotations

import math

import pytest

from rlmesh.reward_server.environments import verifiers_env as V


class _Pydantic:
    def __init__(self, **fields):
        self.fields = fields

    def model_dump(self, exclude_none: bool = False):
        return {k: v for k, v in self.fields.items() if v is not None or not exclude_none}


def test_messages_become_rlmesh_messages_with_text_content_and_tool_ids():
    assert V.to_message(_Pydantic(role="tool", content="42", tool_call_id="call_0_0", name=None)) == \
        {"role": "tool", "content": "42", "tool_call_id": "call_0_0"}
    parts = [{"type": "text", "text": "higher"}, {"type": "text", "text": "!"}]
    assert V.to_message({"role": "user", "content": parts}) == {"role": "user", "content": "higher!"}
    assert V.to_message({"role": "user", "content": None}) == {"role": "user", "content": ""}


def test_a_row_from_an_items_metadata_reads_as_dicts_and_as_objects():
    row = V._row({"answer": "7", "info": {"a": 1}, "example_id": 3.0, "task": "str-task"},
                 [{"role": "user", "content": "Guess."}])
    assert row["example_id"] == 3 and isinstance(row["example_id"], int)  # a Struct's numbers come back as floats
    assert "task" not in row  # the classic string `task` column is refused by verifiers 0.3
    message = row["prompt"][0]
    assert message["content"] == message.content == "Guess." and isinstance(message, dict)
    with pytest.raises(AttributeError):
        message.missing


def test_rewards_and_components_must_be_finite_numbers():
    assert V._scores({"reward": 1.5, "metrics": {"f": 1, "g": 0.5}}, "env") == (1.5, {"f": 1.0, "g": 0.5})
    for state, said in (({"reward": math.nan}, "rubric reward is nan"),
                        ({"reward": 1.0, "metrics": {"f": {"x": 1}}}, "rubric function 'f' is {'x': 1}, not a number"),
                        ({"reward": None}, "rubric reward is None, not a number")):
        with pytest.raises(ValueError, match=said):
            V._scores(state, "env")


def test_hosting_without_verifiers_says_how_to_make_its_virtualenv():
    try:
        import verifiers  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"`verifiers` is not installed .*rlmesh venv"):
            V.load("sophistry-bench-sprint", {})
    else:
        pytest.skip("verifiers is installed in this interpreter")
