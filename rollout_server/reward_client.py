"""The reward-server replicas one rollout server talks to.

`Score` is stateless: calls go round-robin over the replicas and move on to the next one while a
replica is unreachable, retrying with backoff until one answers (a reward tier that restarts costs
time, never a group). A multi-turn session lives in the memory of the replica that answered its
Reset, so an episode takes one replica (`pick`) and sends every Step and Close of its session there.
Environment kinds (single-turn or multi-turn) are learned from `ListEnvironments` and cached.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import grpc

from rlmesh.services.grpc_client import rpc_problem
from rlmesh.services.retry import Backoff, retry
from rlmesh.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
UNREACHABLE = Backoff(0.5, 10.0)
"""Waits between tries at an unreachable reward tier."""
MULTI_TURN = "multi_turn"
AGENT = "agent"


def retryable(err: BaseException) -> bool:
    return isinstance(err, grpc.aio.AioRpcError) and err.code() in RETRYABLE


@dataclass
class Replica:
    address: str
    stub: reward_pb2_grpc.RewardServiceStub


class RewardPool:
    def __init__(self, replicas: list[Replica], *, timeout_s: float) -> None:
        if not replicas:
            raise ValueError("no reward server to talk to: set network.reward_address (host:port, comma-separated "
                             "for several replicas)")
        self.replicas, self.timeout_s = replicas, timeout_s
        self._next = itertools.cycle(range(len(replicas)))
        self._kinds: dict[str, str] = {}

    def pick(self) -> Replica:
        return self.replicas[next(self._next)]

    async def call(self, what: str, method: str, request, *, timeout_s: float | None = None):
        """`method` on the next replica that answers; retries the retryable codes with backoff, and
        raises anything else (the caller decides what that error means for its work)."""

        async def each_replica():
            for i in range(len(self.replicas)):
                replica = self.pick()
                try:
                    return await getattr(replica.stub, method)(request, timeout=timeout_s or self.timeout_s)
                except grpc.aio.AioRpcError as err:
                    if err.code() not in RETRYABLE:
                        raise
                    log.warning("reward server %s: %s (%s); trying the next replica for %s", replica.address,
                                method, err.code().name, what)
                    if i == len(self.replicas) - 1:
                        raise

        return await retry(each_replica, what=f"no reward server answered {method} for {what}",
                           retry_on=retryable, backoff=UNREACHABLE, describe=rpc_problem, log=log)

    async def score(self, request: reward_pb2.ScoreRequest, what: str) -> reward_pb2.ScoreResponse:
        return await self.call(what, "Score", request)

    async def kind(self, env_name: str) -> str:
        """`multi_turn`, `single_turn`, `agent`, or "" for a name no replica serves (Score then reports it)."""
        if env_name not in self._kinds:
            reply = await self.call(f"environment {env_name!r}", "ListEnvironments",
                                    reward_pb2.ListEnvironmentsRequest())
            # A remote that was unreachable when registered has no kind yet: ask again next time.
            self._kinds.update({env.name: env.kind for env in reply.environments if env.kind})
            if env_name not in self._kinds:
                return ""
        return self._kinds[env_name]
