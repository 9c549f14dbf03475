"""The reward servicer: gRPC methods <-> the environment host (`rlmesh.reward_server.host`, which
holds the environments, scores and runs sessions). Here: each request's bounds, the caller's deadline
and identity, and errors as status codes.

`Score` never fails as a call for what an environment does (each item carries its own `error`). Session
calls fail with a status code instead: INVALID_ARGUMENT (bad metadata or session id), NOT_FOUND (unknown
or expired session), FAILED_PRECONDITION (not multi-turn, another replica's session, episode over,
step in flight), DEADLINE_EXCEEDED (the environment missed its timeout), INTERNAL (it raised or
returned a non-finite reward), ABORTED (its remote server is gone). A session whose environment
failed is closed.
"""

from __future__ import annotations

import functools
import logging

import grpc
from google.protobuf.json_format import MessageToDict

from rlmesh.reward_server.environments.agent import AgentEnvironment
from rlmesh.reward_server.environments.base import Message
from rlmesh.reward_server.host import SCORE_MARGIN_S, EnvironmentHost
from rlmesh.reward_server.session_stream import serve_session
from rlmesh.reward_server.sessions import SessionError
from rlmesh.services.auth import peer_tier
from rlmesh.services.domain.chat import as_dicts as to_messages
from rlmesh.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)
__all__ = ["RewardService", "SCORE_MARGIN_S"]

# Share of the caller's remaining deadline given to the environment, so that per-item errors get
# back to the caller before its own deadline ends the whole call.
_DEADLINE_SHARE = 0.9


def caller(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, for per-caller limits: its host (`ipv4:10.0.0.7`), with the tier its
    certificate names under mutual TLS (`rollout@ipv4:10.0.0.7`)."""
    host, tier = context.peer().rsplit(":", 1)[0], peer_tier(context)
    return host if tier is None else f"{tier}@{host}"


def _budget(context: grpc.aio.ServicerContext, limit_s: float | None = None) -> float | None:
    """Seconds the environments get: a share of the caller's remaining deadline, or of `limit_s`
    (the server's own bound) when that is sooner or the caller set none."""
    remaining = context.time_remaining()
    if limit_s is not None:
        remaining = limit_s if remaining is None else min(remaining, limit_s)
    return None if remaining is None else max(remaining * _DEADLINE_SHARE, 0.001)


class RewardService(EnvironmentHost, reward_pb2_grpc.RewardServiceServicer):
    """The environment host (its constructor) served over gRPC."""

    async def Score(self, request, context):
        try:
            self.limits.check_score(request.items)
        except SessionError as err:
            await context.abort(grpc.StatusCode[err.code], str(err))
        budget_s = _budget(context, self.score_timeout_s)
        return reward_pb2.ScoreResponse(results=await self.score(list(request.items), budget_s))

    async def ListEnvironments(self, request, context):
        return reward_pb2.ListEnvironmentsResponse(environments=self.environments())

    async def RegisterEnvironment(self, request, context):
        if not self.allow_register:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "RegisterEnvironment is off on this reward server: it serves only its configured "
                                "environments (declare remote ones in reward.remote, or set "
                                "reward.allow_register=true to accept registrations from any authenticated caller)")
        if not request.name or not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "RegisterEnvironment needs both name and address")
        if request.name in self.local:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"environment {request.name!r} is already served locally; pick another name")
        try:
            info = await self.register_remote(request.name, request.address)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return reward_pb2.RegisterEnvironmentResponse(environment=info)

    async def _session_rpc(self, call, request, context):
        try:
            return await call(request, _budget(context))
        except SessionError as err:
            await context.abort(grpc.StatusCode[err.code], str(err))

    async def Reset(self, request, context):
        return await self._session_rpc(functools.partial(self.reset, owner=caller(context)), request, context)

    async def Step(self, request, context):
        return await self._session_rpc(self.step, request, context)

    async def Close(self, request, context):
        await self._session_rpc(self.close, request, context)
        return reward_pb2.CloseResponse()

    async def Session(self, request_iterator, context):
        async for reply in serve_session(self, request_iterator, context, owner=caller(context)):
            yield reply

    async def RunAgent(self, request, context):
        try:
            env, prompt = self.agent_task(request)
        except SessionError as err:
            await context.abort(grpc.StatusCode[err.code], str(err))
        result = await env.run(prompt, MessageToDict(request.env_metadata), request.base_url, request.api_key)
        if result.error:
            log.warning("agent episode of %s ended without a reward: %s", request.env_name, result.error)
        return reward_pb2.RunAgentResponse(reward=result.reward, components=result.components, error=result.error,
                                           turn_rewards=result.turn_rewards)

    def agent_task(self, request: reward_pb2.RunAgentRequest) -> tuple[AgentEnvironment, list[Message]]:
        """The agent environment a RunAgent names and its prompt, or a SessionError saying what is wrong."""
        env = self.local.get(request.env_name)
        if not isinstance(env, AgentEnvironment):
            agents = sorted(n for n, e in self.local.items() if isinstance(e, AgentEnvironment))
            raise SessionError("NOT_FOUND", f"no agent environment {request.env_name!r} here; agents: "
                                            f"{', '.join(agents) or 'none (reward.agents)'}")
        if not request.base_url.startswith(("http://", "https://")) or len(request.base_url) > 2048:
            raise SessionError("INVALID_ARGUMENT", "RunAgent.base_url must be the episode's http(s) endpoint URL")
        if not 0 < len(request.api_key) <= 512:
            raise SessionError("INVALID_ARGUMENT", "RunAgent.api_key must be the episode's key (1-512 characters)")
        self.limits.check_input(f"RunAgent of {request.env_name!r}", request.prompt, request.env_metadata)
        return env, to_messages(request.prompt)
