"""What an agent process's answer becomes: a reward, or a named reason it cannot be trained on."""

import pytest

from rlmesh.reward_server.environments.agent import AgentEnvironment, parse_answer


def test_a_number_or_a_reward_with_components_is_taken():
    assert parse_answer("a:f", 'log line\n{"reward": 1}\n').reward == 1.0
    got = parse_answer("a:f", '{"reward": 0.5, "components": {"calls": 2}}')
    assert (got.reward, got.components, got.error) == (0.5, {"calls": 2.0}, "")


@pytest.mark.parametrize("stdout, reason", [
    ("", "agent_crashed"), ("not json", "agent_crashed"), ('{"score": 1}', "agent_crashed"),
    ('{"reward": NaN}', "agent_bad_reward"), ('{"reward": "high"}', "agent_bad_reward"),
    ('{"reward": true}', "agent_bad_reward"), ('{"reward": 1, "components": {"x": Infinity}}', "agent_bad_reward"),
])
def test_anything_else_ends_the_episode_with_a_named_reason(stdout, reason):
    got = parse_answer("pkg.mod:agent", stdout)
    assert got.error.startswith(f"{reason}: agent pkg.mod:agent") and got.reward == 0.0


def test_the_agent_path_is_checked_when_configured():
    with pytest.raises(ValueError, match="reward.agents.solver='nocolon' must look like"):
        AgentEnvironment("solver", "nocolon", timeout_s=1.0)
