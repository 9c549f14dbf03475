"""Reward replicas behind one name, as a rollout server sees them: the name resolves (gRPC's own DNS
resolver, asked of a stub DNS server here) to 1, then 3, then 2 real reward servers on loopback
addresses. Score calls spread over every replica the name answers with, a replica that joins gets
calls once connections age out, one that leaves is dropped without a failed call, and each
multi-turn session stays on the replica that opened it while its connection ages out around it."""

from __future__ import annotations

import asyncio
import collections
import socket
import time

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct

from rlmesh.reward_server.service import RewardService
from rlmesh.rollout_server.reward_client import Replica, RewardPool
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import ServerLimits, start_server
from rlmesh.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from tests.integration.dns_stub import StubDNS

pytestmark = pytest.mark.integration
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
AGE_S = 1.5  # network.reward_connection_age_s
TOKEN = "replica-token"  # every call, the streamed sessions' included, must carry it


class CountingReward(RewardService):
    def __init__(self, name: str) -> None:
        super().__init__(replica_id=name, builtin=["arithmetic", "guess_number"])
        self.scored = 0

    async def Score(self, request, context):
        self.scored += 1
        return await super().Score(request, context)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOSTS[0], 0))
        return sock.getsockname()[1]


def _score_request() -> reward_pb2.ScoreRequest:
    meta = Struct()
    meta.update({"answer": "7"})
    return reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id="0", env_name="arithmetic", completion="7",
                                                               env_metadata=meta)])


async def _score_calls(pool: RewardPool, n: int) -> None:
    for _ in range(n):
        reply = await pool.score(_score_request(), "test")
        assert reply.results[0].reward == 1.0 and not reply.results[0].error


def _guess(content: str) -> reward_pb2.SessionRequest:
    return reward_pb2.SessionRequest(step=reward_pb2.StepRequest(
        action=common_pb2.ChatMessage(role="assistant", content=content)))


@pytest.mark.asyncio(loop_scope="session")
async def test_a_reward_name_spreads_calls_over_its_replicas_as_they_join_and_leave():
    port = _free_port()
    services = {host: CountingReward(f"r{i + 1}") for i, host in enumerate(HOSTS)}
    limits = ServerLimits(max_connection_age_s=AGE_S, connection_age_grace_s=60.0)
    servers = {host: await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service,
                                          "rlmesh.v1.RewardService")], host=host, port=port, limits=limits,
                                         token=TOKEN)
               for host, service in services.items()}
    dns = StubDNS(HOSTS[:1])
    target = dns.target("reward.rlmesh.test", port)
    channel = make_channel(target, default_timeout_s=5, balanced=True, token=TOKEN)
    pool = RewardPool([Replica(target, reward_pb2_grpc.RewardServiceStub(channel))], timeout_s=5)

    def counts() -> dict[str, int]:
        return {host: service.scored for host, service in services.items()}

    try:
        await _score_calls(pool, 20)
        assert counts() == {HOSTS[0]: 20, HOSTS[1]: 0, HOSTS[2]: 0}

        # Two replicas join the name: they get calls once the connection to the first one ages out.
        dns.addresses = list(HOSTS)
        joined, start = counts(), time.monotonic()
        while min(c - joined[h] for h, c in counts().items()) < 5:
            assert time.monotonic() - start < 30, f"replicas that joined got no calls in 30 s: {counts()}"
            await _score_calls(pool, 3)
            await asyncio.sleep(0.05)
        print(f"joined replicas served within {time.monotonic() - start:.1f} s")
        before = counts()
        await _score_calls(pool, 90)
        share = {h: c - before[h] for h, c in counts().items()}
        assert all(n >= 20 for n in share.values()), f"calls not spread fairly: {share}"

        # Sessions: each stays on the replica that opened it while connections age out around it.
        sessions = []
        for secret in (3, 9, 14):
            metadata = Struct()
            metadata.update({"secret": secret, "max_turns": 8})
            session, reply = await pool.open_session(reward_pb2.ResetRequest(env_name="guess_number",
                                                                             env_metadata=metadata),
                                                     timeout_s=5, stream_timeout_s=60)
            sessions.append((session, reply.session_id, secret))
        owners = collections.Counter(sid.split("/")[0] for _, sid, _ in sessions)
        assert len(owners) >= 2, f"every session opened on one replica: {owners}"
        await asyncio.sleep(AGE_S * 2)  # every connection those streams started on has been told to go away
        for session, sid, secret in sessions:
            wrong = await session.exchange(_guess("1" if secret > 1 else "16"), 5)
            assert not wrong.step.done and wrong.step.observation, sid
            right = await session.exchange(_guess(str(secret)), 5)
            assert right.step.done and right.step.reward == 1.0, sid
            await session.close(5)
        for service in services.values():
            assert len(service.sessions) == 0, "a session outlived its stream"

        # One replica leaves (its server stops, the name no longer lists it): no call fails.
        dns.addresses = [HOSTS[0], HOSTS[2]]
        await servers[HOSTS[1]].stop(0)
        left = counts()
        await _score_calls(pool, 40)
        after = {h: c - left[h] for h, c in counts().items()}
        assert after[HOSTS[1]] == 0 and after[HOSTS[0]] >= 10 and after[HOSTS[2]] >= 10, after
        assert dns.num_queries >= 2
    finally:
        await channel.close()
        dns.close()
        for server in servers.values():
            await server.stop(0)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_session_whose_replica_dies_fails_and_a_new_one_opens_elsewhere():
    port = _free_port()
    services = {host: CountingReward(f"r{i + 1}") for i, host in enumerate(HOSTS[:2])}
    servers = {host: await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service,
                                          "rlmesh.v1.RewardService")], host=host, port=port, token=TOKEN)
               for host, service in services.items()}
    dns = StubDNS(HOSTS[:2])
    target = dns.target("reward.rlmesh.test", port)
    channel = make_channel(target, default_timeout_s=5, balanced=True, token=TOKEN)
    pool = RewardPool([Replica(target, reward_pb2_grpc.RewardServiceStub(channel))], timeout_s=5)
    reset = reward_pb2.ResetRequest(env_name="guess_number")
    try:
        session, reply = await pool.open_session(reset, timeout_s=5, stream_timeout_s=60)
        owner = HOSTS[int(reply.session_id.split("/")[0][1:]) - 1]
        other = next(h for h in HOSTS[:2] if h != owner)
        dns.addresses = [other]
        await servers[owner].stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await session.exchange(_guess("4"), 5)
        # grpc's core may fail the send itself as the connection dies ("Internal error from Core", seen
        # once under the full suite's load, 2026-12-02) rather than report the peer gone.
        lost = err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or (
            err.value.code() == grpc.StatusCode.INTERNAL and err.value.details() == "Internal error from Core")
        assert lost, err.value
        await session.close(1)
        again, reply = await pool.open_session(reset, timeout_s=5, stream_timeout_s=60)
        assert reply.session_id.startswith(services[other].sessions.replica + "/")
        await again.close(5)
    finally:
        await channel.close()
        dns.close()
        for server in servers.values():
            await server.stop(0)
