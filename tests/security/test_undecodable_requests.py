"""A request whose bytes are not the method's protobuf message is refused with INVALID_ARGUMENT,
naming the method, on every service (they all build their server with `start_server`), and the
server goes on serving; a caller without the token gets UNAUTHENTICATED before anything is parsed.
Real servers on loopback: the reward and learner services, the rollout service's generated base
(its real servicer needs vLLM; the refusal happens before the servicer is called), a
client-streaming method for the streamed-request path, and the reward server's bidirectional
`Session`."""

from __future__ import annotations

import grpc
import pytest
import pytest_asyncio

from rlmesh.learner.rl.membership import LearnerService, Membership
from rlmesh.reward_server.service import RewardService
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server
from rlmesh.v1 import learner_pb2, learner_pb2_grpc, reward_pb2, reward_pb2_grpc, rollout_pb2_grpc

pytestmark = pytest.mark.security
TOKEN = "s3cret"
GARBAGE = b"\xff\xff\xff"  # a field tag whose varint never ends: no message parses from it

ARITHMETIC = reward_pb2.ScoreItem(id="a", env_name="arithmetic", completion="2")
ARITHMETIC.env_metadata.update({"answer": "2"})


def _add_collect(servicer, server: grpc.aio.Server) -> None:
    """/rlmesh.test.Streams/Collect: takes a stream of ScoreRequests, answers how many items came."""
    async def collect(requests, context):
        num_items = [len(request.items) async for request in requests]
        return reward_pb2.ScoreResponse(results=[reward_pb2.ScoreResult(id=str(n)) for n in num_items])

    handler = grpc.stream_unary_rpc_method_handler(collect, request_deserializer=reward_pb2.ScoreRequest.FromString,
                                                   response_serializer=reward_pb2.ScoreResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("rlmesh.test.Streams",
                                                                          {"Collect": handler}),))


@pytest_asyncio.fixture
async def address():
    reward = RewardService(builtin=["arithmetic"])
    learner = LearnerService(Membership(token=TOKEN, rpc_timeout_s=5), "run",
                             lambda: learner_pb2.LearnerStatusResponse(), lambda: 0)
    server = await start_server([
        (reward_pb2_grpc.add_RewardServiceServicer_to_server, reward, "rlmesh.v1.RewardService"),
        (learner_pb2_grpc.add_LearnerServiceServicer_to_server, learner, "rlmesh.v1.LearnerService"),
        (rollout_pb2_grpc.add_RolloutServiceServicer_to_server, rollout_pb2_grpc.RolloutServiceServicer(),
         "rlmesh.v1.RolloutService"),
        (_add_collect, None, "rlmesh.test.Streams"),
    ], port=0, token=TOKEN)
    yield f"127.0.0.1:{server.port}"
    await server.stop(0)


async def _send_garbage(channel: grpc.aio.Channel, method: str, streaming: str, token: str | None):
    """`GARBAGE` as the request (raw bytes: no serializer), as any client of the port could send it."""
    raw = {"unary": channel.unary_unary, "response": channel.unary_stream, "request": channel.stream_unary,
           "both": channel.stream_stream}[streaming]
    call = raw(method, request_serializer=None, response_deserializer=None)
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    if streaming == "both":
        return [reply async for reply in call(iter([GARBAGE]), timeout=5, metadata=metadata)]
    if streaming == "request":
        return await call(iter([GARBAGE]), timeout=5, metadata=metadata)
    if streaming == "response":
        return [reply async for reply in call(GARBAGE, timeout=5, metadata=metadata)]
    return await call(GARBAGE, timeout=5, metadata=metadata)


METHODS = [("/rlmesh.v1.RewardService/Score", "unary"), ("/rlmesh.v1.RewardService/Reset", "unary"),
           ("/rlmesh.v1.LearnerService/Heartbeat", "unary"), ("/rlmesh.v1.RolloutService/UpdateWeights", "unary"),
           ("/rlmesh.v1.RolloutService/Generate", "response"), ("/rlmesh.test.Streams/Collect", "request"),
           ("/rlmesh.v1.RewardService/Session", "both")]


@pytest.mark.parametrize(("method", "streaming"), METHODS)
async def test_undecodable_request_is_invalid_argument_naming_the_method(address, method, streaming):
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _send_garbage(channel, method, streaming, TOKEN)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert method in err.value.details() and "does not parse" in err.value.details(), err.value.details()
    async with make_channel(address, token=TOKEN) as channel:  # the server goes on serving
        reply = await reward_pb2_grpc.RewardServiceStub(channel).Score(reward_pb2.ScoreRequest(items=[ARITHMETIC]))
        assert reply.results[0].reward == 1.0 and not reply.results[0].error


async def test_the_streamed_request_method_takes_valid_messages(address):
    """So that its INVALID_ARGUMENT above is about the garbage, not a broken method."""
    async with grpc.aio.insecure_channel(address) as channel:
        collect = channel.stream_unary("/rlmesh.test.Streams/Collect",
                                       request_serializer=reward_pb2.ScoreRequest.SerializeToString,
                                       response_deserializer=reward_pb2.ScoreResponse.FromString)
        request = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id="x")] * 2)
        reply = await collect(iter([request]), timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert [result.id for result in reply.results] == ["2"]


@pytest.mark.parametrize(("method", "streaming"), METHODS)
async def test_undecodable_request_without_the_token_is_unauthenticated(address, method, streaming):
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _send_garbage(channel, method, streaming, token=None)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
