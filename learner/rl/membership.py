"""Generator membership (register / heartbeat / expire) and the LearnerService servicer.

Heartbeats are paced by the learner: each reply says when to send the next one, at most
HEARTBEATS_PER_S in all, so a thousand rollout servers beat every 10 s rather than 500 times a
second on the learner's event loop; a rollout server expires after `expire_after_s` or three of the
intervals it was told, whichever is longer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from rlmesh.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2_grpc
from rlmesh.services.auth import TLSFiles
from rlmesh.services.grpc_client import make_channel

log = logging.getLogger(__name__)

MIN_HEARTBEAT_S = 2.0
"""Heartbeat interval of a small mesh (and of a rollout server before its first reply)."""
HEARTBEATS_PER_S = 100.0
"""Most heartbeats a second the learner asks for from all rollout servers together."""


@dataclass
class Generator:
    generator_id: str
    address: str
    num_workers: int
    channel: grpc.aio.Channel
    stub: rollout_pb2_grpc.RolloutServiceStub
    version: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    in_group: bool = False
    rank_offset: int = 0
    busy_seconds: float = 0.0  # the rollout server's engine-busy clock, as of the last weight update
    heartbeat_interval_s: float = MIN_HEARTBEAT_S  # what the learner last told it


class Membership:
    """Rollout servers known to the learner. Every change bumps `revision`: a broadcast group formed
    at an older revision is rebuilt before the next update (a change made while a group forms, which
    awaits its members, counts against that group too)."""

    def __init__(self, *, token: str | None, rpc_timeout_s: float, expire_after_s: float = 20.0,
                 tls: TLSFiles | None = None) -> None:
        self.generators: dict[str, Generator] = {}
        self.revision = 0
        self._token, self._rpc_timeout_s, self._expire_after_s = token, rpc_timeout_s, expire_after_s
        self._tls = tls

    def register(self, generator_id: str, address: str, num_workers: int, version: int = 0) -> Generator:
        old = self.generators.pop(generator_id, None)
        if old is not None:
            log.info("rollout server %s registered again", generator_id)
        channel = make_channel(address, token=self._token, default_timeout_s=self._rpc_timeout_s, tls=self._tls,
                               peer="rollout")
        gen = Generator(generator_id, address, max(num_workers, 1), channel, rollout_pb2_grpc.RolloutServiceStub(channel),
                        version=version)
        self.generators[generator_id] = gen
        self.mark_changed()
        log.info("rollout server %s joined from %s (%d worker(s)); it enters the broadcast group at the next update",
                 generator_id, address, gen.num_workers)
        return gen

    def remove(self, generator_id: str, why: str) -> None:
        if self.generators.pop(generator_id, None) is not None:
            self.mark_changed()
            log.warning("rollout server %s left: %s", generator_id, why)

    def mark_changed(self) -> None:
        """The next weight update forms a new broadcast group."""
        self.revision += 1

    def heartbeat(self, generator_id: str, version: int) -> bool:
        gen = self.generators.get(generator_id)
        if gen is None:
            return False
        # A heartbeat sent before a broadcast may land after it: never move a version backwards here.
        gen.last_seen, gen.version = time.monotonic(), max(gen.version, version)
        gen.heartbeat_interval_s = self.heartbeat_interval_s()
        return True

    def heartbeat_interval_s(self) -> float:
        """Seconds between one rollout server's heartbeats: HEARTBEATS_PER_S in all, never more often
        than every MIN_HEARTBEAT_S."""
        return max(MIN_HEARTBEAT_S, len(self.generators) / HEARTBEATS_PER_S)

    def out_of_date(self, version: int) -> list[Generator]:
        """Generators that hold weights other than `version` (joined late, or outlived a learner restart)."""
        return [g for g in self.generators.values() if g.version != version]

    def expire(self) -> None:
        now = time.monotonic()
        for gen in list(self.generators.values()):
            if now - gen.last_seen > max(self._expire_after_s, 3 * gen.heartbeat_interval_s):
                self.remove(gen.generator_id, f"no heartbeat for {now - gen.last_seen:.0f}s")


class LearnerService(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self, membership: Membership, run_id: str, status: Callable[[], learner_pb2.LearnerStatusResponse],
                 version: Callable[[], int]) -> None:
        self.membership, self.run_id, self._status, self._version = membership, run_id, status, version

    async def RegisterGenerator(self, request, context):
        if not request.generator_id or not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "RegisterGenerator needs generator_id and address")
        self.membership.register(request.generator_id, request.address, request.num_workers, request.version)
        return learner_pb2.RegisterGeneratorResponse(run_id=self.run_id, version=self._version())

    async def Deregister(self, request, context):
        self.membership.remove(request.generator_id, "deregistered")
        return learner_pb2.DeregisterResponse()

    async def Heartbeat(self, request, context):
        known = self.membership.heartbeat(request.generator_id, request.version)
        return learner_pb2.HeartbeatResponse(version=self._version(), registered=known,
                                             heartbeat_interval_s=self.membership.heartbeat_interval_s())

    async def GetStatus(self, request, context):
        return self._status()
