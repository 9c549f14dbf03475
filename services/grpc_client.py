"""Client channels: bearer token and trace context on every call, a default deadline on every
call, and gRPC's own retry policy (exponential backoff) for UNAVAILABLE."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
import json
import logging
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.services.auth import TLSFiles
from rlmesh.services.grpc_server import channel_options
from rlmesh.services.telemetry import inject_metadata

log = logging.getLogger(__name__)

_RETRY_SERVICE_CONFIG = json.dumps(
    {
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
)


class _ClientInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
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

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def make_channel(
    address: str,
    *,
    token: str | None = None,
    default_timeout_s: float = 30.0,
    tls: TLSFiles | None = None,
) -> grpc.aio.Channel:
    """An aio channel to `address` (host:port); every call gets `default_timeout_s` unless it
    passes its own `timeout=`."""
    options = channel_options() + [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", _RETRY_SERVICE_CONFIG),
    ]
    interceptors = [_ClientInterceptor(token, default_timeout_s)]
    if tls is not None:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class ExitedWhileStarting(RuntimeError):
    """The process behind a server died before the server became SERVING."""


async def wait_for_serving(
    address: str, *, what: str, timeout_s: float, token: str | None = None, service: str = "",
    alive: Callable[[], bool] | None = None,
) -> None:
    """Poll the standard health service until SERVING; log while waiting; raise on timeout, or at
    once with ExitedWhileStarting when `alive()` says the server's process is gone."""
    deadline = time.monotonic() + timeout_s
    delay, last_log = 0.2, 0.0
    async with make_channel(address, token=token, default_timeout_s=2.0) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                problem: Any = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as err:
                problem = err.code().name
            now = time.monotonic()
            if alive is not None and not alive():
                raise ExitedWhileStarting(f"{what} exited while starting")
            if now >= deadline:
                raise TimeoutError(f"{what} at {address} not SERVING after {timeout_s:.0f}s (last: {problem})")
            if now - last_log > 10:
                log.info("waiting for %s at %s (%s); retrying", what, address, problem)
                last_log = now
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 2.0)
