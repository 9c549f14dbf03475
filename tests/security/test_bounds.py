"""Every bound refuses with a clear status naming the limit and its config key, and the server goes
on serving: message size, calls in flight, Score items, text and metadata sizes, open sessions per
server and per caller, idle sessions closed by a timer, RegisterEnvironment off by default. A real
reward server on loopback, configured from the run config as `rlmesh reward` configures it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct

from rlmesh.reward_server.limits import RequestLimits
from rlmesh.reward_server.service import RewardService
from rlmesh.services.config import load_config
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import ServerLimits, start_server
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc

pytestmark = pytest.mark.security
FNS = "tests.integration.reward_fns"


def _item(i: int, completion: str = "2", **meta) -> reward_pb2.ScoreItem:
    metadata = Struct()
    metadata.update({"answer": "2", **meta})
    return reward_pb2.ScoreItem(id=str(i), env_name="arithmetic", completion=completion, env_metadata=metadata)


async def _reward_server(*overrides: str):
    config = load_config(None, list(overrides))
    section = config.reward
    service = RewardService({"sleepy": f"{FNS}:sleepy_reward"}, builtin=["arithmetic", "guess_number"],
                            replica_id="r", session_idle_timeout_s=section.session_idle_timeout_s,
                            allow_register=section.allow_register, limits=RequestLimits.from_config(section))
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service,
                                  "rlmesh.v1.RewardService")], port=0,
                                limits=ServerLimits.from_config(config.network, "reward"))
    return server, service


async def _still_serves(stub) -> None:
    reply = await stub.Score(reward_pb2.ScoreRequest(items=[_item(0)]))
    assert reply.results[0].reward == 1.0 and not reply.results[0].error


async def _refused(call, code: grpc.StatusCode, *needles: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code, err.value.details()
    for needle in needles:
        assert needle in err.value.details(), err.value.details()


async def test_request_bounds_refuse_with_the_config_key_and_the_server_goes_on():
    server, _ = await _reward_server("reward.max_score_items=8", "reward.max_text_chars=100",
                                     "reward.max_metadata_bytes=200", "network.limits.reward_max_message_mib=1")
    try:
        async with make_channel(f"127.0.0.1:{server.port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            await _refused(stub.Score(reward_pb2.ScoreRequest(items=[_item(i) for i in range(9)])),
                           grpc.StatusCode.INVALID_ARGUMENT, "9 items", "reward.max_score_items=8")
            await _refused(stub.Score(reward_pb2.ScoreRequest(items=[_item(0, "x" * 101)])),
                           grpc.StatusCode.INVALID_ARGUMENT, "completion", "reward.max_text_chars=100")
            long_prompt = _item(0)
            long_prompt.prompt.add(role="user", content="y" * 101)
            await _refused(stub.Score(reward_pb2.ScoreRequest(items=[long_prompt])),
                           grpc.StatusCode.INVALID_ARGUMENT, "prompt", "reward.max_text_chars=100")
            await _refused(stub.Score(reward_pb2.ScoreRequest(items=[_item(0, pad="z" * 300)])),
                           grpc.StatusCode.INVALID_ARGUMENT, "env_metadata", "reward.max_metadata_bytes=200")
            huge = reward_pb2.ScoreRequest(items=[_item(i, pad="p" * 150) for i in range(8000)])  # ~1.5 MiB
            await _refused(stub.Score(huge), grpc.StatusCode.RESOURCE_EXHAUSTED,
                           "network.limits.reward_max_message_mib=1")
            await _still_serves(stub)
    finally:
        await server.stop(0)


async def test_calls_past_the_concurrency_limit_are_refused_while_the_others_finish():
    server, _ = await _reward_server("network.limits.max_concurrent_rpcs=2")
    try:
        async with make_channel(f"127.0.0.1:{server.port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            slow = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id="s", env_name="sleepy", completion="hang",
                                                                       env_metadata=_item(0, sleep_s=1.0).env_metadata)])

            async def score(request):
                return await stub.Score(request)

            busy = [asyncio.create_task(score(slow)) for _ in range(2)]
            await asyncio.sleep(0.3)
            await _refused(stub.Score(reward_pb2.ScoreRequest(items=[_item(0)])), grpc.StatusCode.RESOURCE_EXHAUSTED,
                           "2 calls already in flight", "network.limits.max_concurrent_rpcs=2")
            for reply in await asyncio.gather(*busy):
                assert len(reply.results) == 1
            await _still_serves(stub)
    finally:
        await server.stop(0)


async def test_sessions_are_bounded_per_server_and_per_caller_and_idle_ones_close_on_a_timer():
    server, service = await _reward_server("reward.max_sessions=3", "reward.max_sessions_per_client=2",
                                           "reward.session_idle_timeout_s=0.4")
    reaper = asyncio.create_task(service.close_idle_forever(every_s=0.1))
    reset = reward_pb2.ResetRequest(env_name="guess_number")
    try:
        async with make_channel(f"127.0.0.1:{server.port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            first = [(await stub.Reset(reset)).session_id for _ in range(2)]
            await _refused(stub.Reset(reset), grpc.StatusCode.RESOURCE_EXHAUSTED,
                           "holds 2 open sessions", "reward.max_sessions_per_client=2")
            service.sessions.get(service.sessions.route(first[0])).owner = "someone-else"  # a second caller's
            await stub.Reset(reset)
            await _refused(stub.Reset(reset), grpc.StatusCode.RESOURCE_EXHAUSTED,
                           "3 sessions are open", "reward.max_sessions=3")
            await _still_serves(stub)
            # Nobody calls again: the timer, not the next Reset, closes them.
            await asyncio.sleep(1.0)
            assert len(service.sessions) == 0
            await _refused(stub.Step(reward_pb2.StepRequest(session_id=first[1],
                                                            action=common_pb2.ChatMessage(role="assistant",
                                                                                          content="1"))),
                           grpc.StatusCode.NOT_FOUND, "idle")
            await stub.Reset(reset)  # room again
    finally:
        reaper.cancel()
        await server.stop(0)


async def test_register_environment_is_off_unless_configured():
    server, _ = await _reward_server()
    try:
        async with make_channel(f"127.0.0.1:{server.port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            await _refused(stub.RegisterEnvironment(reward_pb2.RegisterEnvironmentRequest(
                name="arithmetic2", address="10.6.6.6:50052")), grpc.StatusCode.PERMISSION_DENIED,
                "reward.allow_register=true")
            names = [e.name for e in (await stub.ListEnvironments(reward_pb2.ListEnvironmentsRequest())).environments]
            assert "arithmetic2" not in names
    finally:
        await server.stop(0)


def test_generate_requests_past_the_rollout_bounds_are_refused_naming_the_key():
    from rlmesh.rollout_server.service import request_problem
    from rlmesh.services.config import RolloutSection

    cfg = RolloutSection(max_n=8, max_model_len=64)
    group = common_pb2.PromptGroup(group_id="g", n=9)
    assert "rollout.max_n=8" in request_problem(group, [1] * 10, cfg)
    group.n = 8
    assert request_problem(group, [1] * 10, cfg) is None
    assert "rollout.max_model_len=64" in request_problem(group, [1] * 64, cfg)
    group.sampling.max_tokens = 55
    assert "within 1..54" in request_problem(group, [1] * 10, cfg)


async def test_a_session_stream_opens_with_a_reset_counts_against_the_limits_and_closes_when_dropped():
    server, service = await _reward_server("reward.max_sessions_per_client=1", "reward.max_text_chars=100")
    step = reward_pb2.SessionRequest(step=reward_pb2.StepRequest(
        action=common_pb2.ChatMessage(role="assistant", content="3")))
    reset = reward_pb2.SessionRequest(reset=reward_pb2.ResetRequest(env_name="guess_number"))
    try:
        async with make_channel(f"127.0.0.1:{server.port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)

            async def stream(*messages):
                call = stub.Session(timeout=10)
                for message in messages:
                    await call.write(message)
                return call, await call.read()

            for first in (step, reward_pb2.SessionRequest()):
                await _refused(stream(first), grpc.StatusCode.INVALID_ARGUMENT, "first message must be a reset")
            held, opened = await stream(reset)
            assert opened.reset.session_id and len(service.sessions) == 1
            # The stream's session counts like any other: this caller may hold one.
            await _refused(stream(reset), grpc.StatusCode.RESOURCE_EXHAUSTED, "reward.max_sessions_per_client=1")
            await held.write(reset)  # a second reset on an open stream is refused, and ends the session
            await _refused(held.read(), grpc.StatusCode.INVALID_ARGUMENT, "send steps only")
            await asyncio.sleep(0.2)
            assert len(service.sessions) == 0
            # Bounds hold per message, and a caller that just goes away leaves no session behind.
            call, _ = await stream(reset)
            await call.write(reward_pb2.SessionRequest(step=reward_pb2.StepRequest(
                action=common_pb2.ChatMessage(role="assistant", content="9" * 101))))
            await _refused(call.read(), grpc.StatusCode.INVALID_ARGUMENT, "reward.max_text_chars=100")
            call, _ = await stream(reset)
            assert len(service.sessions) == 1
            call.cancel()
            for _ in range(50):
                if len(service.sessions) == 0:
                    break
                await asyncio.sleep(0.05)
            assert len(service.sessions) == 0, "a dropped stream left its session open"
            await _still_serves(stub)
    finally:
        await server.stop(0)
