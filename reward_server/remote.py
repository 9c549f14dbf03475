"""A remote environment: another server implementing RewardService that serves environment `name`,
proxied by name. Whatever the remote does (dies, hangs past its deadline, answers with the wrong
number of results or the wrong ids, returns NaN), `score` gives per-item errors and never raises,
and the session calls raise `SessionError` with a status code that names what happened.

An UNAVAILABLE remote is reported as ABORTED: the proxy's channel has already retried it with
backoff, and the session state lived on the remote, so the caller's own retry would not help.
"""

from __future__ import annotations

import logging

import grpc

from rlmesh.reward_server.environments.base import nonfinite_error
from rlmesh.reward_server.sessions import SessionError
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.services.auth import TLSFiles
from rlmesh.services.grpc_client import make_channel

log = logging.getLogger(__name__)

DESCRIBE_TIMEOUT_S = 2.0


def check_results(env_name: str, address: str, items: list[reward_pb2.ScoreItem],
                  results: list[reward_pb2.ScoreResult]) -> list[reward_pb2.ScoreResult]:
    """The remote's results if they answer `items` one for one, in order, with finite values; else
    an error result per item (a reply that gets the ids wrong cannot be trusted for any of them)."""
    where = f"remote environment {env_name!r} at {address}"
    problem = ""
    if len(results) != len(items):
        problem = f"{where} answered {len(results)} results for {len(items)} items"
    else:
        for j, (item, res) in enumerate(zip(items, results)):
            if res.id != item.id:
                problem = f"{where} answered result {j} with id {res.id!r}, expected {item.id!r}"
                break
    if problem:
        return [reward_pb2.ScoreResult(id=item.id, error=problem) for item in items]
    out = []
    for res in results:
        bad = "" if res.error else nonfinite_error(res.reward, res.components)
        out.append(reward_pb2.ScoreResult(id=res.id, error=f"{where}: {bad}") if bad else res)
    return out


class RemoteEnvironment:
    def __init__(self, name: str, address: str, *, token: str | None, timeout_s: float,
                 tls: TLSFiles | None = None) -> None:
        self.name, self.address, self.timeout_s = name, address, timeout_s
        # An environment server is a reward server: over TLS its certificate names the reward tier.
        self.channel = make_channel(address, token=token, default_timeout_s=timeout_s, tls=tls, peer="reward")
        self._stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.kind = ""
        self.description = ""

    def info(self) -> reward_pb2.EnvironmentInfo:
        return reward_pb2.EnvironmentInfo(name=self.name, kind=self.kind, description=self.description,
                                          remote_address=self.address)

    async def describe(self) -> None:
        """Learn kind and description from the remote. An unreachable remote is fine (it may start
        later); a reachable one that does not serve `name` is a `ValueError`."""
        try:
            reply = await self._stub.ListEnvironments(reward_pb2.ListEnvironmentsRequest(), timeout=DESCRIBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            log.warning("remote environment %s at %s not reachable yet (%s); registered anyway",
                        self.name, self.address, err.code().name)
            return
        served = {e.name: e for e in reply.environments}
        if self.name not in served:
            raise ValueError(f"the server at {self.address} serves {', '.join(sorted(served)) or 'no environments'}, "
                             f"not {self.name!r}; register it under one of those names")
        self.kind, self.description = served[self.name].kind, served[self.name].description

    def _timeout(self, budget_s: float | None) -> float:
        return self.timeout_s if budget_s is None else min(self.timeout_s, budget_s)

    async def score(self, items: list[reward_pb2.ScoreItem], budget_s: float | None) -> list[reward_pb2.ScoreResult]:
        try:
            reply = await self._stub.Score(reward_pb2.ScoreRequest(items=items), timeout=self._timeout(budget_s))
        except grpc.aio.AioRpcError as err:
            msg = f"remote environment {self.name!r} at {self.address} failed: {err.code().name}: {err.details()}"
            return [reward_pb2.ScoreResult(id=item.id, error=msg) for item in items]
        return check_results(self.name, self.address, items, list(reply.results))

    async def _session_call(self, method: str, request, budget_s: float | None):
        try:
            return await getattr(self._stub, method)(request, timeout=self._timeout(budget_s))
        except grpc.aio.AioRpcError as err:
            code = err.code().name
            raise SessionError("ABORTED" if code == "UNAVAILABLE" else code,
                               f"remote environment {self.name!r} at {self.address}: {method} failed: "
                               f"{code}: {err.details()}") from None

    async def reset(self, request: reward_pb2.ResetRequest, budget_s: float | None) -> reward_pb2.ResetResponse:
        reply = await self._session_call("Reset", request, budget_s)
        if not reply.session_id:
            raise SessionError("INTERNAL", f"remote environment {self.name!r} at {self.address}: Reset returned "
                                           "no session_id")
        return reply

    async def step(self, inner_id: str, action, budget_s: float | None) -> reward_pb2.StepResponse:
        reply = await self._session_call("Step", reward_pb2.StepRequest(session_id=inner_id, action=action), budget_s)
        bad = nonfinite_error(reply.reward, reply.components)
        if bad:
            raise SessionError("INTERNAL", f"remote environment {self.name!r} at {self.address}: {bad}")
        return reply

    async def close(self, inner_id: str, budget_s: float | None) -> None:
        await self._session_call("Close", reward_pb2.CloseRequest(session_id=inner_id), budget_s)
