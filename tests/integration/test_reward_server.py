"""Reward servers on real gRPC ports: batched scoring with per-sample errors, user functions,
and a second server plugged in as a remote environment."""

import grpc
import pytest
import pytest_asyncio
from google.protobuf.struct_pb2 import Struct

from reward_server.service import RewardService
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from services.grpc_client import make_channel
from services.grpc_server import start_server

pytestmark = pytest.mark.integration
FNS = "tests.integration.reward_fns"


async def _serve(service: RewardService):
    return await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service,
                                "rlmesh.v1.RewardService")], port=0)


@pytest_asyncio.fixture(loop_scope="session")
async def servers():
    remote = await _serve(RewardService({"length": f"{FNS}:length_reward"}))
    main = await _serve(RewardService({"raises": f"{FNS}:raising_reward"}))
    yield main, remote
    await main.stop(0)
    await remote.stop(0)


def _item(i: str, env: str, completion: str, **meta) -> reward_pb2.ScoreItem:
    s = Struct()
    s.update(meta)
    return reward_pb2.ScoreItem(id=i, env_name=env, completion=completion, env_metadata=s)


@pytest.mark.asyncio(loop_scope="session")
async def test_batched_score_isolates_bad_items(servers):
    main, _ = servers
    async with make_channel(f"127.0.0.1:{main.port}") as channel:
        reply = await reward_pb2_grpc.RewardServiceStub(channel).Score(reward_pb2.ScoreRequest(items=[
            _item("ok", "arithmetic", "7", answer="7"),
            _item("wrong", "arithmetic", "8", answer="7"),
            _item("no-meta", "arithmetic", "7"),
            _item("raises", "raises", "x"),
            _item("unknown", "nope", "x"),
        ]))
    by_id = {r.id: r for r in reply.results}
    assert [r.id for r in reply.results] == ["ok", "wrong", "no-meta", "raises", "unknown"], "order kept"
    assert by_id["ok"].reward == 1.0 and not by_id["ok"].error
    assert by_id["wrong"].reward == 0.0 and not by_id["wrong"].error
    assert "answer" in by_id["no-meta"].error
    assert "KeyError" in by_id["raises"].error and "expected_field" in by_id["raises"].error
    assert "unknown environment 'nope'" in by_id["unknown"].error and "arithmetic" in by_id["unknown"].error


@pytest.mark.asyncio(loop_scope="session")
async def test_remote_environment_is_registered_and_proxied(servers):
    main, remote = servers
    async with make_channel(f"127.0.0.1:{main.port}") as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        info = await stub.RegisterEnvironment(reward_pb2.RegisterEnvironmentRequest(
            name="length", address=f"127.0.0.1:{remote.port}"))
        assert info.environment.remote_address == f"127.0.0.1:{remote.port}"
        envs = {e.name: e for e in (await stub.ListEnvironments(reward_pb2.ListEnvironmentsRequest())).environments}
        assert envs["length"].remote_address and not envs["arithmetic"].remote_address
        reply = await stub.Score(reward_pb2.ScoreRequest(items=[_item("a", "length", "abcd"),
                                                                _item("b", "arithmetic", "2", answer="2")]))
        assert reply.results[0].reward == 4.0 and reply.results[0].components["chars"] == 4.0
        assert reply.results[1].reward == 1.0

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterEnvironment(reward_pb2.RegisterEnvironmentRequest(name="arithmetic", address="x:1"))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterEnvironment(reward_pb2.RegisterEnvironmentRequest(name="", address=""))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.asyncio(loop_scope="session")
async def test_dead_remote_environment_fails_only_its_items(servers):
    main, _ = servers
    async with make_channel(f"127.0.0.1:{main.port}") as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        await stub.RegisterEnvironment(reward_pb2.RegisterEnvironmentRequest(name="gone", address="127.0.0.1:1"))
        reply = await stub.Score(reward_pb2.ScoreRequest(items=[_item("a", "gone", "x"),
                                                                _item("b", "arithmetic", "3", answer="3")]),
                                 timeout=60)
        assert "remote environment 'gone'" in reply.results[0].error and "UNAVAILABLE" in reply.results[0].error
        assert reply.results[1].reward == 1.0


@pytest.mark.asyncio(loop_scope="session")
async def test_sessions_without_a_multi_turn_environment_are_refused_clearly(servers):
    main, _ = servers
    async with make_channel(f"127.0.0.1:{main.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reward_pb2_grpc.RewardServiceStub(channel).Reset(reward_pb2.ResetRequest(env_name="arithmetic"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "multi-turn" in err.value.details()
