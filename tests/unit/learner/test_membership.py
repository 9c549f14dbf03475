"""Membership's heartbeat pacing over the real LearnerService on loopback: the interval the learner
hands out grows with the number of rollout servers (bounded heartbeats a second in all), and a
server paced slowly is not expired for beating at the pace it was told."""

from __future__ import annotations

import time

from rlmesh.learner.rl.membership import HEARTBEATS_PER_S, MIN_HEARTBEAT_S, LearnerService, Membership
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server
from rlmesh.v1 import learner_pb2, learner_pb2_grpc


async def test_the_heartbeat_interval_grows_with_the_number_of_rollout_servers():
    membership = Membership(token=None, rpc_timeout_s=5)
    service = LearnerService(membership, "run", lambda: learner_pb2.LearnerStatusResponse(), lambda: 3)
    server = await start_server([(learner_pb2_grpc.add_LearnerServiceServicer_to_server, service,
                                  "rlmesh.v1.LearnerService")], port=0)
    channel = make_channel(f"127.0.0.1:{server.port}", default_timeout_s=5)
    stub = learner_pb2_grpc.LearnerServiceStub(channel)
    try:
        n = int(5 * MIN_HEARTBEAT_S * HEARTBEATS_PER_S)  # 5x past the point where pacing starts
        for i in range(n):
            membership.register(f"g{i}", f"127.0.0.1:{i + 1}", num_workers=1)
        reply = await stub.Heartbeat(learner_pb2.HeartbeatRequest(generator_id="g0", version=3))
        assert reply.registered and reply.version == 3
        assert reply.heartbeat_interval_s == n / HEARTBEATS_PER_S == 5 * MIN_HEARTBEAT_S
        # Told to come back in 10 s, g0 is still a member 25 s later (3 intervals), gone after 31 s.
        g0 = membership.generators["g0"]
        g0.last_seen = time.monotonic() - 25
        membership.expire()
        assert "g0" in membership.generators
        g0.last_seen = time.monotonic() - 31
        membership.expire()
        assert "g0" not in membership.generators
        # A small mesh beats at the floor: one server told 2 s expires after expire_after_s (20 s).
        for i in range(1, n - 1):
            membership.remove(f"g{i}", "test")
        reply = await stub.Heartbeat(learner_pb2.HeartbeatRequest(generator_id=f"g{n - 1}"))
        assert reply.heartbeat_interval_s == MIN_HEARTBEAT_S
        membership.generators[f"g{n - 1}"].last_seen = time.monotonic() - 21
        membership.expire()
        assert not membership.generators
    finally:
        await channel.close()
        for g in list(membership.generators.values()):
            await g.channel.close()
        await server.stop(0)
