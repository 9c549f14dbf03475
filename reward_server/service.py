"""Reward servicer: protobuf <-> environment calls. Local environments run in a thread; remote
ones are proxied to the server registered for them."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import grpc
from google.protobuf.json_format import MessageToDict

from reward_server.environments.arithmetic import ArithmeticEnvironment
from reward_server.environments.base import ScoreInput, SingleTurnEnvironment
from reward_server.environments.function import FunctionEnvironment
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from services.grpc_client import make_channel

log = logging.getLogger(__name__)

BUILTIN = {"arithmetic": ArithmeticEnvironment}


class RewardService(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, functions: dict[str, str] | None = None, *, token: str | None = None,
                 remote_timeout_s: float = 30.0) -> None:
        self.local: dict[str, SingleTurnEnvironment] = {name: cls() for name, cls in BUILTIN.items()}
        for name, path in (functions or {}).items():
            self.local[name] = FunctionEnvironment(name, path)
        self.remote: dict[str, tuple[str, reward_pb2_grpc.RewardServiceStub]] = {}
        self._token, self._remote_timeout_s = token, remote_timeout_s

    def register_remote(self, name: str, address: str) -> reward_pb2.EnvironmentInfo:
        if name in self.local:
            raise ValueError(f"environment {name!r} is already served locally; pick another name")
        channel = make_channel(address, token=self._token, default_timeout_s=self._remote_timeout_s)
        self.remote[name] = (address, reward_pb2_grpc.RewardServiceStub(channel))
        log.info("environment %s now proxied to %s", name, address)
        return reward_pb2.EnvironmentInfo(name=name, kind="single_turn", remote_address=address)

    def environments(self) -> list[reward_pb2.EnvironmentInfo]:
        infos = [reward_pb2.EnvironmentInfo(name=n, kind="single_turn", description=e.description)
                 for n, e in sorted(self.local.items())]
        infos += [reward_pb2.EnvironmentInfo(name=n, kind="single_turn", remote_address=a)
                  for n, (a, _) in sorted(self.remote.items())]
        return infos

    async def score(self, items: list[reward_pb2.ScoreItem]) -> list[reward_pb2.ScoreResult]:
        results: list[reward_pb2.ScoreResult | None] = [None] * len(items)
        by_env: dict[str, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            by_env[item.env_name].append(i)

        async def run(env_name: str, idx: list[int]) -> None:
            if env_name in self.local:
                env = self.local[env_name]
                inputs = [ScoreInput(items[i].id, [{"role": m.role, "content": m.content} for m in items[i].prompt],
                                     items[i].completion, MessageToDict(items[i].env_metadata)) for i in idx]
                try:
                    outputs = await asyncio.to_thread(env.score, inputs)
                except Exception as err:
                    log.exception("environment %s failed on a batch of %d", env_name, len(idx))
                    msg = f"environment {env_name!r} raised {type(err).__name__}: {err}"
                    outputs = [None] * len(idx)
                    for i in idx:
                        results[i] = reward_pb2.ScoreResult(id=items[i].id, error=msg)
                    return
                for i, out in zip(idx, outputs):
                    results[i] = reward_pb2.ScoreResult(id=items[i].id, reward=out.reward,
                                                        components=out.components, error=out.error)
            elif env_name in self.remote:
                address, stub = self.remote[env_name]
                try:
                    reply = await stub.Score(reward_pb2.ScoreRequest(items=[items[i] for i in idx]))
                except grpc.aio.AioRpcError as err:
                    msg = f"remote environment {env_name!r} at {address} failed: {err.code().name}: {err.details()}"
                    for i in idx:
                        results[i] = reward_pb2.ScoreResult(id=items[i].id, error=msg)
                    return
                for i, res in zip(idx, reply.results):
                    results[i] = res
            else:
                known = sorted([*self.local, *self.remote])
                for i in idx:
                    results[i] = reward_pb2.ScoreResult(
                        id=items[i].id, error=f"unknown environment {env_name!r}; known: {', '.join(known)}")

        await asyncio.gather(*(run(env, idx) for env, idx in by_env.items()))
        return results  # type: ignore[return-value]

    # --- gRPC methods -------------------------------------------------------------------------

    async def Score(self, request, context):
        return reward_pb2.ScoreResponse(results=await self.score(list(request.items)))

    async def ListEnvironments(self, request, context):
        return reward_pb2.ListEnvironmentsResponse(environments=self.environments())

    async def RegisterEnvironment(self, request, context):
        if not request.name or not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "RegisterEnvironment needs both name and address")
        try:
            info = self.register_remote(request.name, request.address)
        except ValueError as err:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(err))
        return reward_pb2.RegisterEnvironmentResponse(environment=info)

    async def _proxy_session(self, method: str, env_name: str | None, request, context):
        # Sessions are served by remote multi-turn environments; no built-in one is multi-turn yet.
        if env_name is not None and env_name in self.remote:
            return await getattr(self.remote[env_name][1], method)(request)
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{method}: environment {env_name!r} has no multi-turn sessions here; register a remote "
            "multi-turn environment with RegisterEnvironment",
        )

    async def Reset(self, request, context):
        return await self._proxy_session("Reset", request.env_name, request, context)

    async def Step(self, request, context):
        return await self._proxy_session("Step", None, request, context)

    async def Close(self, request, context):
        return await self._proxy_session("Close", None, request, context)
