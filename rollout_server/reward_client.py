"""The reward-server replicas one rollout server talks to.

Each entry of `network.reward_address` is a name (host:port): its channel resolves every address
behind the name with gRPC's own DNS resolver and spreads calls over them round-robin (a Kubernetes
headless Service, or a compose service scaled to several containers, answers with every replica).
The channel resolves the name again whenever a connection ends, and reward servers end each
connection after `network.reward_connection_age_s`, so replicas that join get calls within about
that long and ones that leave are dropped at once. Several entries (`a:50052,b:50052`) are taken in
turn.

`Score` is stateless: a call that meets an unreachable replica is tried again with backoff until one
answers (a reward tier that restarts costs time, never a group). A multi-turn session lives in the
memory of the replica that answered its reset, so an episode is one `Session` stream (`EnvSession`),
which gRPC keeps on the replica that opened it. Environment kinds (single-turn or multi-turn) are
learned from `ListEnvironments` and cached.
"""

from __future__ import annotations

import asyncio
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
    """One entry of `network.reward_address`: a name, and a stub whose channel balances over its replicas."""

    address: str
    stub: reward_pb2_grpc.RewardServiceStub


def _failed(code: grpc.StatusCode, details: str | None) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class EnvSession:
    """One multi-turn session: a `Session` stream, which stays on the replica that answered its reset."""

    def __init__(self, call, address: str) -> None:
        self._call, self.address = call, address

    async def exchange(self, request: reward_pb2.SessionRequest, timeout_s: float) -> reward_pb2.SessionResponse:
        """Send a reset or step and wait up to `timeout_s` for its answer (TimeoutError past it);
        a stream the server ended raises its status as `AioRpcError`."""
        try:
            await self._call.write(request)
        except asyncio.InvalidStateError:  # the stream has ended already (its replica went away)
            raise _failed(await self._call.code(), await self._call.details()) from None
        reply = await asyncio.wait_for(self._call.read(), timeout_s)
        if reply is grpc.aio.EOF:  # the server ended the stream without an error: it should not
            raise _failed(grpc.StatusCode.INTERNAL, "the reward server ended the session's stream without answering")
        return reply

    async def close(self, timeout_s: float) -> None:
        """End the stream (the server closes the session); cancel it when the server does not finish in time."""
        try:
            await asyncio.wait_for(self._end(), timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError) as err:
            log.debug("ending a session's stream on %s: %r", self.address, err)
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Drop the stream at once (the server closes its session)."""
        self._call.cancel()

    async def _end(self) -> None:
        if not self._call.done():
            await self._call.done_writing()
        await self._call.code()  # the server's end of the stream: its session is closed by then


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

    async def open_session(self, reset: reward_pb2.ResetRequest, *, timeout_s: float,
                           stream_timeout_s: float) -> tuple[EnvSession, reward_pb2.ResetResponse]:
        """A session opened with `reset` on the next name's replicas: waits while the reward tier is
        unreachable (nothing is lost yet), and raises any other error. `timeout_s` bounds the reset's
        answer, `stream_timeout_s` the whole session."""

        async def attempt() -> tuple[EnvSession, reward_pb2.ResetResponse]:
            replica = self.pick()
            session = EnvSession(replica.stub.Session(timeout=stream_timeout_s), replica.address)
            try:
                reply = await session.exchange(reward_pb2.SessionRequest(reset=reset), timeout_s)
            except BaseException:
                session.cancel()
                raise
            return session, reply.reset

        def unreachable(err: BaseException) -> bool:
            return isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE

        return await retry(attempt, what=f"no reward server answered the reset of {reset.env_name!r}",
                           retry_on=unreachable, backoff=UNREACHABLE, describe=rpc_problem, log=log)

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
