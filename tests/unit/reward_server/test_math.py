"""The `math` environment with real math-verify in real worker processes: answer extraction
(boxed, ####, last number), equivalent forms (fractions, LaTeX, units, thousands separators), the
format component, the reference read from a GSM8K worked solution, and a per-item timeout that
kills a pathological parse without holding up the other items."""

import time

import pytest

from rlmesh.reward_server.environments.base import ScoreInput
from rlmesh.reward_server.environments.math import MathEnvironment, extract_answer, reference_answer
from rlmesh.reward_server.service import RewardService

SOLUTION = "She buys 3 * 4 = <<3*4=12>>12 apples.\nNow she has 5 + 12 = <<5+12=17>>17 apples.\n#### 17"


@pytest.fixture(scope="module")
def env():
    env = MathEnvironment(timeout_s=3.0, num_workers=2)
    yield env
    env.pool.close()


def _item(completion: str, answer) -> ScoreInput:
    return ScoreInput("i", [{"role": "user", "content": "q"}], completion, {"answer": answer})


def test_extraction_prefers_boxed_then_hash_then_the_last_number():
    assert extract_answer(r"so $x = \boxed{\frac{1}{2}}$. Also 7") == (r"\frac{1}{2}", "boxed")
    assert extract_answer(r"\boxed{1} then \boxed{\sqrt{a_{1}}}") == (r"\sqrt{a_{1}}", "boxed")
    assert extract_answer("5 + 12 = 17\n#### 17 apples\nmore 3") == ("17 apples", "hash")
    assert extract_answer("It costs 1,234 dollars, or 3.5 each.") == ("3.5", "number")
    assert extract_answer(r"cut off \boxed{12") == ("12", "number")
    assert extract_answer("no idea") == (None, "none")
    assert reference_answer(SOLUTION) == "17" and reference_answer(r"\boxed{3/4}") == "3/4"
    assert reference_answer(17.0) == "17.0"


@pytest.mark.parametrize("completion, answer, correct, fmt", [
    (r"Working... so the answer is \boxed{17}.", SOLUTION, 1.0, 1.0),
    ("5 + 12 = 17\n#### 17", SOLUTION, 1.0, 1.0),
    ("She has 17 apples.", SOLUTION, 1.0, 0.0),             # last number, no format
    ("She has 17 apples, then eats 1.", SOLUTION, 0.0, 0.0),
    (r"\boxed{\frac{3}{4}}", "0.75", 1.0, 1.0),              # fraction vs decimal
    (r"\boxed{\dfrac{6}{8}}", r"\frac{3}{4}", 1.0, 1.0),     # LaTeX vs LaTeX
    ("#### 3/4", r"\boxed{\frac34}", 1.0, 1.0),
    (r"\boxed{18 \text{ dollars}}", "18", 1.0, 1.0),         # units stripped
    (r"\boxed{\$18}", "#### 18", 1.0, 1.0),
    ("#### 1,234", "1234", 1.0, 1.0),                        # thousands separator
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}/2", 1.0, 1.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0, 1.0),
    (r"\boxed{x^2+1}", "1 + x^2", 1.0, 1.0),
    (r"\boxed{x^2+2}", "1 + x^2", 0.0, 1.0),
])
def test_equivalent_forms_score_as_correct(env, completion, answer, correct, fmt):
    (out,) = env.score([_item(completion, answer)])
    assert out.error == ""
    assert out.components["correct"] == correct and out.components["format"] == fmt, out
    assert out.reward == correct and out.components["timeout"] == 0.0


def test_format_weight_and_missing_answer():
    env = MathEnvironment(format_weight=0.1, num_workers=1)
    try:
        right_unformatted, wrong_boxed = env.score([_item("it is 17", "17"), _item(r"\boxed{16}", "17")])
        assert right_unformatted.reward == 1.0 and wrong_boxed.reward == pytest.approx(0.1)
        (no_answer,) = env.score([ScoreInput("i", [], "17", {})])
        assert "no 'answer' field" in no_answer.error
        (nothing,) = env.score([_item("I do not know", "17")])
        assert nothing.reward == 0.0 and nothing.components["extracted"] == 0.0
    finally:
        env.pool.close()


def test_a_pathological_parse_is_killed_at_the_timeout_and_the_pool_recovers(env):
    nested = r"\boxed{" + "(" * 2000 + "1" + ")" * 2000 + "}"  # math-verify alone parses this for ~50 s
    t0 = time.monotonic()
    slow, fine = env.score([_item(nested, "1"), _item(r"\boxed{17}", SOLUTION)])
    elapsed = time.monotonic() - t0
    assert slow.error == "" and slow.reward == 0.0 and slow.components["timeout"] == 1.0
    assert fine.reward == 1.0 and fine.components["timeout"] == 0.0
    assert 3.0 <= elapsed < 15.0, elapsed
    assert env.pool.num_killed >= 1
    # The killed worker was replaced: a batch of ordinary items is scored as before.
    outs = env.score([_item(rf"\boxed{{{n}}}", str(n)) for n in range(6)])
    assert [o.reward for o in outs] == [1.0] * 6


async def test_the_reward_server_serves_math_as_a_built_in():
    from rlmesh.v1 import reward_pb2

    service = RewardService(builtin=["math"])
    try:
        item = reward_pb2.ScoreItem(id="a", env_name="math", completion=r"\boxed{\frac{1}{2}}")
        item.env_metadata.update({"answer": "0.5"})
        (result,) = await service.score([item])
        assert result.error == "" and result.reward == 1.0 and result.components["correct"] == 1.0
    finally:
        service.local["math"].pool.close()
