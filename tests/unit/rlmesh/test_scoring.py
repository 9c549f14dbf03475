"""The exact-integer rule every built-in environment scores by, and the environments that use it."""

import pytest

from rlmesh.services.domain.scoring import as_int, first_integer, score_integer
from rlmesh.reward_server.environments.calculator import CalculatorEnvironment
from rlmesh.reward_server.environments.mcp_tools import exact_answer


@pytest.mark.parametrize("answer, correct, in_text", [
    ("579", 1.0, 1.0), (" 579\n", 1.0, 1.0), ("0579", 1.0, 1.0), ("579!", 0.0, 1.0), ("It is 579.", 0.0, 1.0),
    ("579.0", 0.0, 1.0), ("5 79", 0.0, 0.0), ("578", 0.0, 0.0), ("", 0.0, 0.0), ("--579", 0.0, 0.0),
])
def test_score_integer(answer, correct, in_text):
    assert score_integer(answer, 579) == (correct, in_text)


def test_negative_answers():
    assert score_integer("-3", -3) == (1.0, 1.0)
    assert score_integer("3", -3) == (0.0, 0.0)


@pytest.mark.parametrize("value, expected", [
    (7, 7), (7.0, 7), ("7", 7), (" -7 ", -7), ("7.00", 7), (7.5, None), ("7.5", None), ("seven", None),
    (True, None), (None, None), ("--7", None), ("", None),
])
def test_as_int(value, expected):
    assert as_int(value) == expected


def test_first_integer():
    assert first_integer("higher than 12, maybe -4") == 12
    assert first_integer("no number") is None


def test_calculator_and_mcp_default_score_by_the_same_rule():
    env = CalculatorEnvironment()
    for answer, want in (("579", 1.0), ("579!", 0.0), (" 579 ", 1.0)):
        reset = env.reset({"answer": 579.0, "a": 123, "b": 456}, [{"role": "user", "content": "What is 123 + 456?"}])
        out = env.step(reset.state, {"role": "assistant", "content": answer})
        assert out.reward == want == out.components["correct"]
        assert out.components["answer_in_text"] == 1.0
        assert exact_answer(answer, {"answer": 579.0}, [])["correct"] == want
    assert exact_answer("Paris", {"answer": "Paris"}, [])["correct"] == 1.0  # not an integer: the same text
    assert exact_answer("", {}, [])["correct"] == 0.0
