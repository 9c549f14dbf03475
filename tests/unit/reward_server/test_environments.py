import pytest

from rlmesh.reward_server.environments.arithmetic import ArithmeticEnvironment
from rlmesh.reward_server.environments.base import ScoreInput, load_callable
from rlmesh.reward_server.environments.function import FunctionEnvironment


def _item(completion, **metadata):
    return ScoreInput("0", [{"role": "user", "content": "2+2="}], completion, metadata)


def test_arithmetic_scores_exact_answers():
    env = ArithmeticEnvironment()
    out = env.score([_item("4", answer="4"), _item(" 5", answer="4"), _item("-3 ", answer="-3"),
                     _item("", answer="1"), _item("4!", answer="4")])
    assert [o.reward for o in out] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert out[4].components["answer_in_text"] == 1.0, "right number, wrong format"
    assert not any(o.error for o in out)


def test_arithmetic_reports_unscorable_items():
    out = ArithmeticEnvironment().score([_item("4"), _item("4", answer="four")])
    assert "no 'answer'" in out[0].error
    assert "not an integer" in out[1].error


def reward_len(prompt, completion, metadata):
    return {"reward": len(completion), "chars": len(completion)}


def reward_raises(prompt, completion, metadata):
    raise RuntimeError("boom")


def test_function_environment_isolates_a_raising_function():
    ok = FunctionEnvironment("len", f"{__name__}:reward_len").score([_item("abc")])
    assert ok[0].reward == 3.0 and ok[0].components == {"chars": 3.0}
    bad = FunctionEnvironment("bad", f"{__name__}:reward_raises").score([_item("abc"), _item("d")])
    assert all("RuntimeError: boom" in o.error for o in bad)


@pytest.mark.parametrize("path", ["nocolon", "no.such.module:f", f"{__name__}:missing"])
def test_bad_import_path_is_a_clear_error(path):
    with pytest.raises(ValueError, match="reward function"):
        load_callable(path)
