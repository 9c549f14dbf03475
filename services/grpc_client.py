"""Client channels: bearer token and trace context on every call, a default deadline on every
call, and gRPC's own retry policy (exponential backoff) for UNAVAILABLE."""

from __future__ import annotations

from collections.abc import Callable
import json
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.services.auth import TLSFiles
from rlmesh.services.grpc_server import channel_options
from rlmesh.services.retry import Backoff, retry
from rlmesh.services.telemetry import inject_metadata

log = logging.getLogger(__name__)

# (first, longest) wait between a channel's attempts to connect, in ms: a peer that comes up is
# reached within ~2 s, at the cost of one refused dial every 2 s while it is down.
RECONNECT_BACKOFF_MS = (500, 2000)

_RETRY = {
    "methodConfig": [
        {
            "name": [{}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.2s",
                "maxBackoff": "5s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}
# The shortest time between two DNS resolutions of one name (gRPC's default: 30 s): a replica that
# joined is found within seconds of a connection ending.
MIN_RESOLVE_INTERVAL_MS = 5000
_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:")


def balanced_target(address: str) -> str:
    """The gRPC target that resolves every address behind `address` (host:port) by DNS, or `address`
    unchanged when it already names a resolver (`dns:`, `ipv4:`, ...)."""
    return address if address.startswith(_SCHEMES) else f"dns:///{address}"


class _ClientInterceptor:
    """Adds the bearer token, the trace context and a default deadline to a call."""

    def __init__(self, token: str | None, default_timeout_s: float) -> None:
        self._token = token
        self._timeout = default_timeout_s

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = list(details.metadata or ())
        if self._token is not None:
            metadata.append(("authorization", f"Bearer {self._token}"))
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=details.timeout if details.timeout is not None else self._timeout,
            metadata=grpc.aio.Metadata(*inject_metadata(metadata)),
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )


# One interceptor object per kind of call: grpc.aio files an interceptor under the first of the four
# kinds it implements only, so one object implementing all four would miss every streaming call.
class _UnaryUnary(_ClientInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_ClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_ClientInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_ClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def make_channel(
    address: str,
    *,
    token: str | None = None,
    default_timeout_s: float = 30.0,
    tls: TLSFiles | None = None,
    peer: str | None = None,
    balanced: bool = False,
) -> grpc.aio.Channel:
    """An aio channel to `address` (host:port); every call gets `default_timeout_s` unless it
    passes its own `timeout=`. Over TLS, `peer` (the tier dialled: learner, rollout, reward) is the
    name the server's certificate must carry when `tls.server_name_is_tier`. `balanced` connects to
    every address the name resolves to and spreads calls over them round-robin (gRPC's own DNS
    resolver and `round_robin` policy), resolving again whenever a connection ends."""
    service_config = dict(_RETRY, loadBalancingConfig=[{"round_robin": {}}]) if balanced else _RETRY
    options = channel_options() + [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(service_config)),
        # The service config is ours alone: a DNS TXT record may not replace it.
        ("grpc.service_config_disable_resolution", 1),
        ("grpc.dns_min_time_between_resolutions_ms", MIN_RESOLVE_INTERVAL_MS),
        # gRPC's reconnect backoff grows to 120 s by default: a rollout server that started minutes
        # before its learner (SFT first) would dial it again only up to two minutes after it listens.
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]
    interceptors = [kind(token, default_timeout_s) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
    if balanced:
        address = balanced_target(address)
    if tls is not None:
        if peer is not None and tls.server_name_is_tier:
            options.append(("grpc.ssl_target_name_override", peer))
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class ExitedWhileStarting(RuntimeError):
    """The process behind a server died before the server became SERVING."""


class NotServing(RuntimeError):
    """A health check answered, with a status other than SERVING."""


def rpc_problem(err: BaseException) -> str:
    """A failed call in a few words for a log line: its status code and details."""
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return str(err)


_STARTING = Backoff(0.2, 2.0, multiplier=1.5)


async def wait_for_serving(
    address: str, *, what: str, timeout_s: float, token: str | None = None, service: str = "",
    alive: Callable[[], bool] | None = None, tls: TLSFiles | None = None, peer: str | None = None,
) -> None:
    """Poll the standard health service until SERVING; log while waiting; raise on timeout, or at
    once with ExitedWhileStarting when `alive()` says the server's process is gone."""
    async with make_channel(address, token=token, default_timeout_s=2.0, tls=tls, peer=peer) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def check() -> None:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                raise NotServing(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

        def exited(err: BaseException) -> None:
            if alive is not None and not alive():
                raise ExitedWhileStarting(f"{what} exited while starting")

        def timed_out(err: BaseException, elapsed_s: float) -> TimeoutError:
            return TimeoutError(f"{what} at {address} not SERVING after {timeout_s:.0f}s (last: {rpc_problem(err)})")

        await retry(check, what=f"waiting for {what} at {address}", retry_on=(grpc.aio.AioRpcError, NotServing),
                    backoff=_STARTING, deadline_s=timeout_s, give_up=timed_out, on_failure=exited,
                    describe=rpc_problem, log=log, level=logging.INFO, log_every_s=10.0)
