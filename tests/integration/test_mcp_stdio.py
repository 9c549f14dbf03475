"""A real third-party stdio MCP server from PyPI (`mcp-server-calculator`) launched by command
(`reward.mcp.<name>.command`) and served as a multi-turn environment through the reward server's
gRPC API: one server process per episode, tools/list feeds Reset, tool calls run, the answer is
scored, Close ends the process, and a server killed mid-episode fails the Step naming its command
(which the rollout server ends as `env_error`).

The package pins `mcp<2` while rlmesh pins mcp 2.x, so it lives in a virtualenv of its own, made
once under the user's cache directory (skipped, saying so, only when the package registry cannot be
reached)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

from rlmesh.reward_server.environments.mcp_tools import McpToolEnvironment
from rlmesh.reward_server.service import RewardService
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

pytestmark = pytest.mark.integration

PACKAGE = "mcp-server-calculator==0.2.1"
_OFFLINE = ("No matching distribution", "NewConnectionError", "Network is unreachable", "Temporary failure in name "
            "resolution", "Could not fetch URL", "ConnectTimeout", "ReadTimeout")


@pytest.fixture(scope="session")
def calculator_command() -> list[str]:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlmesh-tests"
    venv = cache / f"venv-{PACKAGE.replace('==', '-')}"
    program = venv / "bin" / "mcp-server-calculator"
    if not program.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", PACKAGE], capture_output=True, text=True,
                             timeout=600)
        if pip.returncode != 0:
            output = pip.stdout + pip.stderr
            if any(sign in output for sign in _OFFLINE):
                pytest.skip(f"cannot install {PACKAGE} from the package registry (unreachable?): {output[-300:]}")
            raise AssertionError(f"pip install {PACKAGE} failed:\n{output}")
    return [str(program)]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def reward(calculator_command):
    service = RewardService(builtin=[], env_timeout_s=30)
    service.add_local("calc", McpToolEnvironment("calc", command=calculator_command, env={"CALC_TEST": "1"},
                                                 score=None, max_turns=3, call_timeout_s=20))
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service,
                                  "rlmesh.v1.RewardService")], port=0)
    channel = make_channel(f"127.0.0.1:{server.port}", default_timeout_s=40)
    yield reward_pb2_grpc.RewardServiceStub(channel)
    await channel.close()
    await server.stop(0)


def _servers(command: list[str]) -> list[int]:
    """Pids of this test process's calculator servers."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and command[0] in (entry / "cmdline").read_bytes().decode(errors="replace") \
                    and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                pids.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def _call(expression: str) -> common_pb2.ChatMessage:
    body = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
    return common_pb2.ChatMessage(role="assistant", content=f"<tool_call>\n{body}\n</tool_call>")


async def _reset(stub, answer: int) -> reward_pb2.ResetResponse:
    meta = Struct()
    meta.update({"answer": answer})
    return await stub.Reset(reward_pb2.ResetRequest(env_name="calc", env_metadata=meta, prompt=[
        common_pb2.ChatMessage(role="user", content="What is 123 * 456?")]))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stdio_server_runs_one_process_per_episode(reward, calculator_command):
    stub = reward
    first, second = await _reset(stub, 56088), await _reset(stub, 7)
    assert len(_servers(calculator_command)) == 2  # one server process per open episode
    tools = [MessageToDict(t)["function"] for t in first.tools]
    assert [t["name"] for t in tools] == ["calculate"] and tools[0]["parameters"]["required"] == ["expression"]

    step = await stub.Step(reward_pb2.StepRequest(session_id=first.session_id, action=_call("123 * 456")))
    assert not step.done and [(m.role, m.name, m.content) for m in step.observation] == [("tool", "calculate",
                                                                                          "56088")]
    step = await stub.Step(reward_pb2.StepRequest(session_id=first.session_id, action=common_pb2.ChatMessage(
        role="assistant", content="56088")))
    assert step.done and step.reward == 1.0 and dict(step.components) == {"correct": 1.0, "num_tool_calls": 1.0}
    for reset in (first, second):
        await stub.Close(reward_pb2.CloseRequest(session_id=reset.session_id))
    for _ in range(50):  # the SDK's stdio client ends the process on close
        if not _servers(calculator_command):
            break
        await asyncio.sleep(0.1)
    assert _servers(calculator_command) == []


@pytest.mark.asyncio(loop_scope="session")
async def test_a_server_killed_mid_episode_fails_the_step_naming_its_command(reward, calculator_command):
    stub = reward
    reset = await _reset(stub, 3)
    [pid] = _servers(calculator_command)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Step(reward_pb2.StepRequest(session_id=reset.session_id, action=_call("1 + 2")))
    print(f"killed stdio server: {err.value.code().name}: {err.value.details()}")
    # Not DEADLINE_EXCEEDED: the rollout server ends the episode as env_error, not step_timeout.
    assert err.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED
    assert calculator_command[0] in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError):  # the session is gone with its server
        await stub.Step(reward_pb2.StepRequest(session_id=reset.session_id, action=_call("1 + 2")))
    # The next episode gets a fresh server.
    fresh = await _reset(stub, 3)
    step = await stub.Step(reward_pb2.StepRequest(session_id=fresh.session_id, action=_call("1 + 2")))
    assert step.observation[0].content == "3"
    await stub.Close(reward_pb2.CloseRequest(session_id=fresh.session_id))


def test_a_command_that_cannot_start_fails_reset_naming_it():
    env = McpToolEnvironment("nope", command=["/nonexistent/mcp-server"], score=None, max_turns=2, call_timeout_s=5)
    with pytest.raises(ConnectionError, match="/nonexistent/mcp-server"):
        env.reset({}, [])
