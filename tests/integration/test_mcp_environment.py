"""An MCP tool server (a real one, in its own process) served as a multi-turn environment through
the reward server's gRPC API: tools/list feeds Reset's tools, tool calls run through tools/call,
the final answer is scored, and a server killed mid-episode fails the Step with its URL named."""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import pytest
import pytest_asyncio
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct

from rlmesh.reward_server.environments.mcp_tools import McpToolEnvironment
from rlmesh.reward_server.service import RewardService
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server
from rlmesh.services.ports import free_port
from tests.integration.env_servers import start_mcp_server

pytestmark = pytest.mark.integration


def _call(name: str, **arguments) -> common_pb2.ChatMessage:
    body = json.dumps({"name": name, "arguments": arguments})
    return common_pb2.ChatMessage(role="assistant", content=f"<tool_call>\n{body}\n</tool_call>")


@pytest_asyncio.fixture(loop_scope="session")
async def reward():
    port = free_port()
    mcp = start_mcp_server(port)
    url = f"http://127.0.0.1:{port}/mcp"
    service = RewardService(builtin=[], env_timeout_s=20)
    service.add_local("mcp_calc", McpToolEnvironment("mcp_calc", url, score=None, max_turns=3, call_timeout_s=5))
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service,
                                  "rlmesh.v1.RewardService")], port=0)
    channel = make_channel(f"127.0.0.1:{server.port}", default_timeout_s=20)
    yield reward_pb2_grpc.RewardServiceStub(channel), mcp, url
    await channel.close()
    await server.stop(0)
    if mcp.poll() is None:
        os.killpg(mcp.pid, signal.SIGKILL)
    mcp.wait()


async def _reset(stub, answer: int) -> reward_pb2.ResetResponse:
    meta = Struct()
    meta.update({"answer": answer})
    return await stub.Reset(reward_pb2.ResetRequest(env_name="mcp_calc", env_metadata=meta, prompt=[
        common_pb2.ChatMessage(role="user", content="What is 123 + 456?")]))


@pytest.mark.asyncio(loop_scope="session")
async def test_mcp_tools_are_offered_called_and_the_answer_scored(reward):
    stub, _, _ = reward
    listed = await stub.ListEnvironments(reward_pb2.ListEnvironmentsRequest())
    assert {e.name: e.kind for e in listed.environments} == {"mcp_calc": "multi_turn"}
    reset = await _reset(stub, 579)
    tools = {t["function"]["name"]: t["function"] for t in (MessageToDict(t) for t in reset.tools)}
    assert set(tools) == {"add", "slow_add"}
    assert tools["add"]["description"] == "Add two integers and return their sum."
    assert tools["add"]["parameters"]["required"] == ["a", "b"]

    step = await stub.Step(reward_pb2.StepRequest(session_id=reset.session_id, action=_call("add", a=123, b=456)))
    assert not step.done and [(m.role, m.name, m.content) for m in step.observation] == [("tool", "add", "579")]
    # Mistakes are observations the model reads, not failures.
    step = await stub.Step(reward_pb2.StepRequest(session_id=reset.session_id, action=_call("add", a="x")))
    assert not step.done and step.observation[0].content.startswith("error: ")
    step = await stub.Step(reward_pb2.StepRequest(session_id=reset.session_id, action=common_pb2.ChatMessage(
        role="assistant", content="579")))
    assert step.done and step.reward == 1.0
    assert dict(step.components) == {"correct": 1.0, "num_tool_calls": 2.0}
    await stub.Close(reward_pb2.CloseRequest(session_id=reset.session_id))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_killed_mcp_server_fails_the_step_naming_it(reward):
    stub, mcp, url = reward
    reset = await _reset(stub, 3)
    os.killpg(mcp.pid, signal.SIGKILL)
    mcp.wait()
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Step(reward_pb2.StepRequest(session_id=reset.session_id, action=_call("add", a=1, b=2)))
    assert url in err.value.details(), err.value.details()
    print(f"killed server: {err.value.code().name} after {time.monotonic() - t0:.1f}s: {err.value.details()}")
    assert time.monotonic() - t0 < 15
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a new episode cannot even start
        await _reset(stub, 3)
    assert url in err.value.details() and err.value.code() != grpc.StatusCode.OK
