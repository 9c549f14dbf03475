"""What an agent process's answer becomes: a reward, or a named reason it cannot be trained on."""

import pytest

from rlmesh.reward_server.environments.agent import AgentEnvironment, parse_answer


def test_a_number_or_a_reward_with_components_is_taken():
    assert parse_answer("a:f", 'log line\n{"reward": 1}\n').reward == 1.0
    got = parse_answer("a:f", '{"reward": 0.5, "components": {"calls": 2}}')
    assert (got.reward, got.components, got.error, got.turn_rewards) == (0.5, {"calls": 2.0}, "", [])
    turns = parse_answer("a:f", '{"reward": 1.5, "turn_rewards": [0.5, 1]}')
    assert (turns.reward, turns.turn_rewards, turns.error) == (1.5, [0.5, 1.0], "")


@pytest.mark.parametrize("stdout, reason", [
    ("", "agent_crashed"), ("not json", "agent_crashed"), ('{"score": 1}', "agent_crashed"),
    ('{"reward": NaN}', "agent_bad_reward"), ('{"reward": "high"}', "agent_bad_reward"),
    ('{"reward": true}', "agent_bad_reward"), ('{"reward": 1, "components": {"x": Infinity}}', "agent_bad_reward"),
    ('{"reward": 1, "turn_rewards": [0.5, NaN]}', "agent_bad_reward"),
    ('{"reward": 1, "turn_rewards": {"0": 1}}', "agent_bad_reward"),
    ('{"reward": 1, "turn_rewards": ["1"]}', "agent_bad_reward"),
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
    # the launcher and the episode it forked
    while len(agents := psutil.Process(server.pid).children(recursive=True)) < 2:
        assert time.monotonic() < deadline, "the agent never started"
        time.sleep(0.2)
    server.send_signal(signal.SIGKILL)
    server.wait()
    gone, alive = psutil.wait_procs(agents, timeout=10)
    assert alive == [] and gone


def test_the_agent_is_imported_once_and_each_episode_is_its_own_process(tmp_path, monkeypatch):
    """Episodes fork from a launcher that imported the agent once: module-level code runs once, each
    episode has its own process, environment, random stream and temporary directory, and what one
    episode changes in the module or plants in its temporary directory is not seen by the next."""
    import asyncio
    import os

    import certifi  # a CA bundle that exists: the clients the agent makes load it

    imports, tmpdirs = tmp_path / "imports", tmp_path / "tmpdirs"
    (tmp_path / "counted_agent.py").write_text(
        "import os, random, tempfile\n"
        f"open({str(imports)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "tempfile.gettempdir()  # the launcher's import caches a temporary directory\n"
        "SEEN = []\n"
        "import openai\n"
        "from agents import set_default_openai_client\n"
        "from agents.models import _openai_shared\n"
        "def agent(prompt, metadata):\n"
        "    SEEN.append(1)\n"
        "    # clients the openai module and the Agents SDK cache per process, made from this episode's key\n"
        "    cached = openai._client is not None or _openai_shared.get_default_openai_client() is not None\n"
        "    set_default_openai_client(openai.AsyncOpenAI(), use_for_tracing=False)\n"
        "    client_key = float(openai._load_client().api_key)\n"
        "    tmp = tempfile.gettempdir()\n"
        "    found = len(os.listdir(tmp))\n"
        "    open(os.path.join(tmp, 'planted'), 'w').write('from an earlier episode')\n"
        f"    open({str(tmpdirs)!r}, 'a').write(tmp + '\\n')\n"
        "    return {'reward': random.random(), 'components': {'pid': os.getpid(), 'seen': len(SEEN),\n"
        "            'key': float(os.environ['OPENAI_API_KEY']), 'found': found, 'cached': float(cached),\n"
        "            'client_key': client_key,\n"
        f"            'ca': float(os.environ.get('SSL_CERT_FILE') == {certifi.where()!r})}}}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = AgentEnvironment("counted", "counted_agent:agent", timeout_s=30, ca_file=certifi.where())

    async def episodes():
        run = [env.run([{"role": "user", "content": "x"}], {}, "http://127.0.0.1:9/v1", str(k)) for k in range(5)]
        first = await asyncio.gather(*run[:4])
        return [*first, await run[4]]  # one more after the others have made their clients

    try:
        results = asyncio.run(episodes())
    finally:
        env.close()
    assert [r.error for r in results] == [""] * 5
    assert len(imports.read_text().split()) == 1  # imported once, in the launcher
    assert len({r.components["pid"] for r in results}) == 5 and os.getpid() not in {r.components["pid"] for r in results}
    assert [r.components["seen"] for r in results] == [1.0] * 5
    assert [r.components["ca"] for r in results] == [1.0] * 5  # the CA of the endpoint's certificate
    assert [r.components["key"] for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0]  # each its own episode's key
    assert [r.components["cached"] for r in results] == [0.0] * 5  # no client an earlier episode made
    assert [r.components["client_key"] for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len({r.reward for r in results}) == 5  # not one random stream copied into every episode
    dirs = tmpdirs.read_text().split()
    assert len(set(dirs)) == 5 and all("rlmesh-agent-" in d for d in dirs)  # each its own TMPDIR
    assert [r.components["found"] for r in results] == [0.0] * 5  # none saw a file another planted
    assert not any(os.path.exists(d) for d in dirs)  # and each is gone with its episode


def test_a_command_agent_reads_its_task_on_stdin_and_fails_by_name():
    """An agent given as a command: the task as JSON on stdin, the episode's key in its environment, the
    reward its last line of stdout (what it printed before is not the answer); one that hangs is killed
    at the timeout, one that exits non-zero ends `agent_crashed` with its stderr."""
    import asyncio
    import sys

    answering = [sys.executable, "-c",
                 "import json, os, sys\n"
                 "task = json.load(sys.stdin)\n"
                 "print('thinking...')\n"
                 "print(json.dumps({'reward': len(task['prompt']) + task['metadata']['bonus'],\n"
                 "                  'components': {'key': float(os.environ['OPENAI_API_KEY'])}}))\n"]
    bare = [sys.executable, "-c", "print(0.25)"]
    hanging = [sys.executable, "-c", "import time; time.sleep(600)"]
    crashing = [sys.executable, "-c", "import sys; sys.exit('no model answered')"]

    async def episode(command, timeout_s=30.0):
        env = AgentEnvironment("cmd", command, timeout_s=timeout_s)
        try:
            return await env.run([{"role": "user", "content": "x"}], {"bonus": 2}, "http://127.0.0.1:9/v1", "7")
        finally:
            env.close()

    async def all_of_them():
        return await asyncio.gather(episode(answering), episode(bare), episode(hanging, timeout_s=1.0),
                                    episode(crashing))

    answered, plain, hung, crashed = asyncio.run(all_of_them())
    assert (answered.error, answered.reward, answered.components) == ("", 3.0, {"key": 7.0})
    assert (plain.error, plain.reward) == ("", 0.25)
    assert hung.error.startswith("agent_timeout: agent ") and "agent_timeout_s=1.0s" in hung.error
    assert crashed.error.startswith("agent_crashed: ") and "no model answered" in crashed.error
    with pytest.raises(ValueError, match="a command is a non-empty list"):
        AgentEnvironment("cmd", [], timeout_s=1.0)


def test_a_launcher_that_dies_fails_its_episodes_by_name_and_the_next_episode_gets_a_new_one(tmp_path, monkeypatch):
    """An agent that kills its launcher (what an out-of-memory kill would do) ends its own episode
    `agent_crashed` naming the launcher; the next episode is served by a launcher started afresh."""
    import asyncio

    (tmp_path / "fatal_agent.py").write_text(
        "import os, signal\n"
        "def agent(prompt, metadata):\n"
        "    if metadata.get('kill'):\n"
        "        os.kill(os.getppid(), signal.SIGKILL)\n"
        "        import time; time.sleep(60)\n"
        "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = AgentEnvironment("fatal", "fatal_agent:agent", timeout_s=30)

    async def episodes():
        killed = await env.run([{"role": "user", "content": "x"}], {"kill": True}, "http://127.0.0.1:9/v1", "k")
        after = await env.run([{"role": "user", "content": "x"}], {}, "http://127.0.0.1:9/v1", "k")
        return killed, after

    try:
        killed, after = asyncio.run(episodes())
    finally:
        env.close()
    assert killed.error.startswith("agent_crashed: agent fatal_agent:agent: its launcher process exited with -9")
    assert (after.error, after.reward) == ("", 1.0)


def test_the_reward_server_runs_reward_agent_max_concurrency_episodes_of_an_agent_at_once(tmp_path, monkeypatch):
    """Twelve episodes that each wait for all twelve to have started: every one sees the others with
    `reward.agent_max_concurrency: 12` on the server `rlmesh reward` builds (with 8 slots, as agents
    once had from env_max_concurrency, the first eight wait out their deadline and score 0)."""
    import asyncio

    from rlmesh.reward_server.server import build_service
    from rlmesh.services.config import RunConfig

    started = tmp_path / "started"
    started.mkdir()
    (tmp_path / "gathering_agent.py").write_text(
        "import os, time\n"
        "def agent(prompt, metadata):\n"
        f"    open(os.path.join({str(started)!r}, str(os.getpid())), 'w').close()\n"
        "    deadline = time.monotonic() + 20\n"
        f"    while len(os.listdir({str(started)!r})) < 12 and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        f"    return {{'reward': float(len(os.listdir({str(started)!r})) >= 12)}}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = RunConfig.model_validate({"reward": {"agents": {"gathering": "gathering_agent:agent"},
                                                  "agent_max_concurrency": 12}})
    assert RunConfig().reward.agent_max_concurrency == 64  # the default: a rollout server's groups at once
    env = build_service(config, token=None, tls=None).local["gathering"]

    async def episodes():
        return await asyncio.gather(*[env.run([{"role": "user", "content": "x"}], {}, "http://127.0.0.1:9/v1", "k")
                                      for _ in range(12)])

    try:
        results = asyncio.run(episodes())
    finally:
        env.close()
    assert [r.error for r in results] == [""] * 12
    assert [r.reward for r in results] == [1.0] * 12
