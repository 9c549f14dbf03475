"""An agent's reward per model call lands on the episode's turns, or fails the episode by name."""

from rlmesh.rollout_server.agents import credit_turns
from rlmesh.rollout_server.episode import EpisodeTrace
from rlmesh.v1 import common_pb2


def _trace(num_calls: int) -> EpisodeTrace:
    trace = EpisodeTrace(context=[1, 2], num_prompt=2)
    trace.turns = [common_pb2.Turn(start=3 * i, num_sampled_tokens=2) for i in range(num_calls)]
    return trace


def test_one_reward_per_call_goes_on_its_turn():
    trace = _trace(3)
    credit_turns(trace, [0.5, 0.0, 1.0], "solver")
    assert [t.reward for t in trace.turns] == [0.5, 0.0, 1.0] and not trace.error


def test_a_count_that_is_not_the_calls_fails_the_episode_by_name():
    trace = _trace(2)
    credit_turns(trace, [1.0], "solver")
    assert trace.finish_reason == "agent_bad_reward"
    assert "1 turn_rewards for 2 model call(s)" in trace.error and "'solver'" in trace.error
    assert [t.reward for t in trace.turns] == [0.0, 0.0], "no turn is credited from a list that does not fit"
