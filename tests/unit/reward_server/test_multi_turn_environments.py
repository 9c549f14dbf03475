import pytest

from rlmesh.reward_server.environments.base import is_multi_turn
from rlmesh.reward_server.environments.calculator import ADD_TOOL, CalculatorEnvironment, add
from rlmesh.reward_server.environments.guess_number import GuessNumberEnvironment
from rlmesh.reward_server.environments.tool_calls import format_tool_call

PROMPT = [{"role": "user", "content": "task"}]


def _say(text):
    return {"role": "assistant", "content": text}


def test_guess_number_answers_higher_lower_correct():
    env = GuessNumberEnvironment()
    assert is_multi_turn(env) and env.tools() == []
    reset = env.reset({"secret": 7, "max_turns": 5}, PROMPT)
    assert reset.observation == [], "a dataset prompt already states the game"
    steps = [env.step(reset.state, _say(t)) for t in ("3", "I guess 10", "7")]
    assert [s.observation[0]["content"] for s in steps] == ["higher", "lower", "correct"]
    assert [s.done for s in steps] == [False, False, True]
    assert [s.reward for s in steps] == [0.0, 0.0, 1.0]
    assert steps[-1].components["correct"] == 1.0 and steps[-1].metadata["turns"] == 3


def test_guess_number_without_a_number_is_an_observation_and_turns_run_out():
    env = GuessNumberEnvironment()
    state = env.reset({"secret": 2, "max_turns": 2}, PROMPT).state
    first = env.step(state, _say("hmm, no idea"))
    assert "no number" in first.observation[0]["content"] and not first.done
    last = env.step(state, _say("5"))
    assert last.done and last.reward == 0.0 and last.components["correct"] == 0.0
    assert last.metadata["end"] == "max_turns" and "lower" in last.observation[0]["content"]
    with pytest.raises(ValueError, match="episode is over"):
        env.step(state, _say("2"))


def test_guess_number_secret_from_seed_or_rng_within_range():
    env = GuessNumberEnvironment(seed=1)
    a = env.reset({"seed": 42, "low": 1, "high": 100}, PROMPT).state.secret
    assert a == env.reset({"seed": 42, "low": 1, "high": 100}, PROMPT).state.secret
    secrets = {env.reset({"low": 3, "high": 5}, PROMPT).state.secret for _ in range(50)}
    assert secrets == {3, 4, 5}
    rules = env.reset({"secret": 4}, []).observation
    assert "between 1 and 16" in rules[0]["content"], "an empty prompt gets the rules"


@pytest.mark.parametrize("metadata, error", [({"secret": 99}, "outside"), ({"low": "x"}, "metadata.low"),
                                             ({"max_turns": 0}, "max_turns")])
def test_guess_number_bad_metadata_is_a_value_error(metadata, error):
    with pytest.raises(ValueError, match=error):
        GuessNumberEnvironment().reset(metadata, PROMPT)


def test_calculator_runs_the_add_tool_then_scores_the_answer():
    env = CalculatorEnvironment()
    assert env.tools() == [ADD_TOOL]
    state = env.reset({"a": 123, "b": 456, "answer": 579}, PROMPT).state
    call = env.step(state, _say(format_tool_call("add", {"a": 123, "b": 456})))
    assert call.observation == [{"role": "tool", "name": "add", "content": "579"}]
    assert not call.done and call.reward == 0.0
    final = env.step(state, _say(" 579\n"))
    assert final.done and final.reward == 1.0 and final.observation == []
    assert final.components == {"correct": 1.0, "num_tool_calls": 1.0, "correct_tool_calls": 1.0,
                                "answer_in_text": 1.0}


def test_calculator_rewards_the_first_right_tool_call_on_its_turn():
    env = CalculatorEnvironment()
    state = env.reset({"a": 123, "b": 456, "answer": 579, "tool_call_reward": 0.25, "max_turns": 4}, PROMPT).state
    wrong = env.step(state, _say(format_tool_call("add", {"a": 123, "b": 455})))
    right = env.step(state, _say(format_tool_call("add", {"a": 456, "b": 123}) + format_tool_call("add", {"a": 1})))
    again = env.step(state, _say(format_tool_call("add", {"a": 123, "b": 456})))
    final = env.step(state, _say("579"))
    assert [s.reward for s in (wrong, right, again, final)] == [0.0, 0.25, 0.0, 1.0]
    assert final.components["num_tool_calls"] == 4.0 and final.components["correct_tool_calls"] == 2.0
    assert sum(s.reward for s in (wrong, right, again, final)) == 1.25, "the episode's reward is its turns' sum"
    plain = env.reset({"answer": 579}, PROMPT).state
    assert env.step(plain, _say(format_tool_call("add", {"a": 123, "b": 456}))).reward == 0.0, "off by default"


@pytest.mark.parametrize("value", [-0.1, float("nan"), "0.5", True])
def test_calculator_tool_call_reward_is_checked(value):
    with pytest.raises(ValueError, match="tool_call_reward"):
        CalculatorEnvironment().reset({"answer": 3, "tool_call_reward": value}, PROMPT)


def test_calculator_wrong_or_wordy_answer_scores_zero():
    env = CalculatorEnvironment()
    wrong = env.step(env.reset({"answer": 579}, PROMPT).state, _say("578"))
    wordy = env.step(env.reset({"answer": 579}, PROMPT).state, _say("It is 579."))
    assert wrong.done and wrong.reward == 0.0 and wrong.components["answer_in_text"] == 0.0
    assert wordy.reward == 0.0 and wordy.components["answer_in_text"] == 1.0


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{not json}</tool_call>", "error: the tool call is not valid JSON"),
    ('<tool_call>{"name": "mul", "arguments": {"a": 1, "b": 2}}</tool_call>', "error: unknown tool 'mul'"),
    ('<tool_call>{"name": "add", "arguments": {"a": "x", "b": 2}}</tool_call>', "error: add needs integer"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "b=None"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}', "never closed"),
])
def test_calculator_malformed_calls_are_observations(text, error):
    env = CalculatorEnvironment()
    out = env.step(env.reset({"answer": 3}, PROMPT).state, _say(text))
    assert not out.done and len(out.observation) == 1
    assert out.observation[0]["role"] == "tool" and error in out.observation[0]["content"]


def test_calculator_ends_after_max_turns_of_tool_calls():
    env = CalculatorEnvironment()
    state = env.reset({"answer": 3, "max_turns": 2}, PROMPT).state
    call = _say(format_tool_call("add", {"a": 1, "b": 2}) + format_tool_call("add", {"a": 0, "b": 3}))
    assert len(env.step(state, call).observation) == 2
    last = env.step(state, call)
    assert last.done and last.reward == 0.0 and last.metadata["end"] == "max_turns"
    assert last.components["num_tool_calls"] == 4.0


def test_calculator_metadata_is_checked():
    with pytest.raises(ValueError, match="metadata.answer"):
        CalculatorEnvironment().reset({}, PROMPT)
    with pytest.raises(ValueError, match="metadata.a and metadata.b"):
        CalculatorEnvironment().reset({"answer": 3}, [])
    rules = CalculatorEnvironment().reset({"a": 1, "b": 2, "answer": 3}, []).observation
    assert "1 + 2" in rules[0]["content"]


def test_add_tool_accepts_numeric_strings_and_rejects_extras():
    assert add({"a": "12", "b": 30}) == "42"
    assert add({"a": True, "b": 1}).startswith("error")
    assert "got also c" in add({"a": 1, "b": 2, "c": 3})
