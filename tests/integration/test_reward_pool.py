"""A rollout server's reward replicas (`network.reward_address: a,b`): Score calls are spread over
them and move on when one is down; an episode's session stays on the replica that answered Reset."""

import pytest

from rlmesh.reward_server.service import RewardService
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.rollout_server.reward_client import MULTI_TURN, Replica, RewardPool
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server

pytestmark = pytest.mark.integration


async def _replica(name: str):
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server,
                                  RewardService(replica_id=name), "rlmesh.v1.RewardService")], port=0)
    address = f"127.0.0.1:{server.port}"
    return server, Replica(address, reward_pb2_grpc.RewardServiceStub(make_channel(address, default_timeout_s=5)))


def _score_request(n: int) -> reward_pb2.ScoreRequest:
    from google.protobuf.struct_pb2 import Struct

    meta = Struct()
    meta.update({"answer": "7"})
    return reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id=str(i), env_name="arithmetic", completion="7",
                                                               env_metadata=meta) for i in range(n)])


@pytest.mark.asyncio(loop_scope="session")
async def test_score_spreads_over_replicas_and_fails_over():
    (s0, r0), (s1, r1) = await _replica("r0"), await _replica("r1")
    pool = RewardPool([r0, r1], timeout_s=5)
    assert await pool.kind("calculator") == MULTI_TURN and await pool.kind("arithmetic") == "single_turn"
    assert await pool.kind("nope") == ""
    picked = {pool.pick().address for _ in range(4)}
    assert picked == {r0.address, r1.address}
    await s0.stop(0)  # one replica goes away: every call still gets scored, by the other
    for _ in range(4):
        reply = await pool.score(_score_request(3), "test")
        assert [r.reward for r in reply.results] == [1.0, 1.0, 1.0]
    # A session id names the replica that answered its Reset (the episode sends its Steps there).
    reset = await r1.stub.Reset(reward_pb2.ResetRequest(env_name="guess_number"), timeout=5)
    assert reset.session_id.startswith("r1/guess_number/")
    await s1.stop(0)
