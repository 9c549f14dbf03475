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


def test_an_agent_dies_with_its_reward_server():
    """A reward server killed outright (SIGKILL: no cleanup runs) leaves no agent behind."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    code = ("import asyncio\nfrom rlmesh.reward_server.environments.agent import AgentEnvironment\n"
            "env = AgentEnvironment('h', 'tests.integration.episode_envs:hanging_agent', timeout_s=600)\n"
            "asyncio.run(env.run([{'role': 'user', 'content': 'x'}], {}, 'http://127.0.0.1:9/v1', 'k'))\n")
    server = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 30
    while not (agents := psutil.Process(server.pid).children(recursive=True)):
        assert time.monotonic() < deadline, "the agent never started"
        time.sleep(0.2)
    server.send_signal(signal.SIGKILL)
    server.wait()
    gone, alive = psutil.wait_procs(agents, timeout=10)
    assert alive == [] and gone
