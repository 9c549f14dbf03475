"""`Session`: one multi-turn session as one bidirectional stream.

The first message is a reset, every later one a step; the session is closed when the caller ends
the stream, cancels it, or its deadline passes — so a rollout server that dies mid-episode leaves
nothing behind (unary sessions wait for the idle eviction). Each message gets the same checks and
errors as the unary `Reset` and `Step` (the stream ends with that status code), and each call into
the environment is bounded as theirs are. A stream is one HTTP/2 stream on one connection, so it
stays on the replica that opened it whatever balances the caller's channel: that is how sessions
stay whole when a reward name has several replicas.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from rlmesh.reward_server.sessions import SessionError
from rlmesh.v1 import reward_pb2

log = logging.getLogger(__name__)


class Sessions(Protocol):
    """What a stream needs of the reward servicer (`RewardService`): its session calls."""

    async def reset(self, request: reward_pb2.ResetRequest, budget_s: float | None = None, *,
                    owner: str = "") -> reward_pb2.ResetResponse: ...

    async def step(self, request: reward_pb2.StepRequest, budget_s: float | None = None) -> reward_pb2.StepResponse: ...

    async def close(self, request: reward_pb2.CloseRequest, budget_s: float | None = None) -> None: ...


async def serve_session(service: Sessions, requests: AsyncIterator[reward_pb2.SessionRequest],
                        context: grpc.aio.ServicerContext, *,
                        owner: str) -> AsyncIterator[reward_pb2.SessionResponse]:
    """Answer one stream's reset and steps; close its session however the stream ends. The stream's
    deadline covers the whole episode, so each environment call gets the server's own bound
    (`reward.env_timeout_s`, or `reward.remote_timeout_s` for a remote environment)."""
    session_id = ""
    try:
        async for message in requests:
            kind = message.WhichOneof("kind")
            if not session_id:
                if kind != "reset":
                    raise SessionError("INVALID_ARGUMENT", "Session: the stream's first message must be a reset "
                                                           f"(got {kind or 'an empty message'})")
                reply = await service.reset(message.reset, owner=owner)
                session_id = reply.session_id
                yield reward_pb2.SessionResponse(reset=reply)
            else:
                if kind != "step":
                    raise SessionError("INVALID_ARGUMENT", f"Session: after the reset, send steps only (got "
                                                           f"{kind or 'an empty message'})")
                message.step.session_id = session_id
                yield reward_pb2.SessionResponse(step=await service.step(message.step))
    except SessionError as err:
        await context.abort(grpc.StatusCode[err.code], str(err))
    finally:
        if session_id:
            # Shielded: a cancelled stream (the caller went away) still closes its session.
            await asyncio.shield(_close(service, session_id))


async def _close(service: Sessions, session_id: str) -> None:
    try:
        await service.close(reward_pb2.CloseRequest(session_id=session_id))
    except SessionError as err:
        log.warning("closing session %s at the end of its stream failed: %s", session_id, err)
