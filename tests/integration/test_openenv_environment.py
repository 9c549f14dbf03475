"""An OpenEnv environment server (a real one, in its own process, built on openenv-core's
`create_app`) served as a multi-turn environment through the reward server's gRPC API: reset takes
metadata keys, each step is a WebSocket step, the server's reward and done end the episode, and a
step that raises, a step past its deadline and a server killed mid-episode each fail the call with
the server's URL named."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
import pytest_asyncio
from google.protobuf.struct_pb2 import Struct

from rlmesh.reward_server.environments.openenv_remote import OpenEnvEnvironment
from rlmesh.reward_server.service import RewardService
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server
from rlmesh.services.ports import free_port
from tests.integration.env_servers import start_openenv_server

pytestmark = pytest.mark.integration
CALL_TIMEOUT_S = 3.0


@pytest_asyncio.fixture(loop_scope="session")
async def reward():
    port = free_port()
    server_proc = start_openenv_server(port)
    url = f"http://127.0.0.1:{port}"
    service = RewardService(builtin=[], env_timeout_s=20)
    service.add_local("guess", OpenEnvEnvironment("guess", url, reset_keys=["target"], max_turns=5,
                                                  call_timeout_s=CALL_TIMEOUT_S))
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service,
                                  "rlmesh.v1.RewardService")], port=0)
    channel = make_channel(f"127.0.0.1:{server.port}", default_timeout_s=20)
    yield reward_pb2_grpc.RewardServiceStub(channel), server_proc, url
    await channel.close()
    await server.stop(0)
    if server_proc.poll() is None:
        os.killpg(server_proc.pid, signal.SIGKILL)
    server_proc.wait()


async def _reset(stub, target: int) -> reward_pb2.ResetResponse:
    meta = Struct()
    meta.update({"target": target, "unrelated": "not passed to reset"})
    return await stub.Reset(reward_pb2.ResetRequest(env_name="guess", env_metadata=meta, prompt=[
        common_pb2.ChatMessage(role="user", content="Guess my number.")]))


async def _step(stub, session_id: str, text: str) -> reward_pb2.StepResponse:
    return await stub.Step(reward_pb2.StepRequest(session_id=session_id, action=common_pb2.ChatMessage(
        role="assistant", content=text)))


@pytest.mark.asyncio(loop_scope="session")
async def test_an_openenv_episode_runs_through_the_reward_server(reward):
    stub, _, _ = reward
    listed = await stub.ListEnvironments(reward_pb2.ListEnvironmentsRequest())
    assert {e.name: e.kind for e in listed.environments} == {"guess": "multi_turn"}
    reset = await _reset(stub, 42)
    assert [(m.role, m.content) for m in reset.observation] == [
        ("user", "I picked a number from 1 to 100. Guess it.")]
    assert list(reset.tools) == []
    feedback = []
    for text in ("hello", "10", "50"):
        step = await _step(stub, reset.session_id, text)
        assert not step.done and step.reward == 0.0
        feedback.append([(m.role, m.content) for m in step.observation])
    # The target came from the dataset metadata through reset's keyword arguments.
    assert feedback == [[("user", "Say a number.")], [("user", "Higher.")], [("user", "Lower.")]]
    step = await _step(stub, reset.session_id, "It is 42.")
    assert step.done and step.reward == 1.0 and not step.observation
    await stub.Close(reward_pb2.CloseRequest(session_id=reset.session_id))

    # max_turns ends an episode the server has not ended.
    reset = await _reset(stub, 7)
    for turn in range(5):
        step = await _step(stub, reset.session_id, "1")
    assert step.done and step.reward == 0.0
    await stub.Close(reward_pb2.CloseRequest(session_id=reset.session_id))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_failing_slow_or_killed_openenv_server_fails_the_call_naming_it(reward):
    stub, server_proc, url = reward
    reset = await _reset(stub, 3)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _step(stub, reset.session_id, "raise")
    assert url in err.value.details() and "the guessing game exploded" in err.value.details(), err.value.details()

    reset = await _reset(stub, 3)
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _step(stub, reset.session_id, "sleep")
    assert url in err.value.details() and f"{CALL_TIMEOUT_S}s" in err.value.details(), err.value.details()
    assert time.monotonic() - t0 < CALL_TIMEOUT_S + 5

    reset = await _reset(stub, 3)
    assert not (await _step(stub, reset.session_id, "1")).done
    os.killpg(server_proc.pid, signal.SIGKILL)
    server_proc.wait()
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _step(stub, reset.session_id, "2")
    print(f"killed server: {err.value.code().name} after {time.monotonic() - t0:.1f}s: {err.value.details()}")
    assert url in err.value.details(), err.value.details()
    assert time.monotonic() - t0 < CALL_TIMEOUT_S + 5
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a new episode cannot even start
        await _reset(stub, 3)
    assert url in err.value.details() and err.value.code() != grpc.StatusCode.OK
