"""Asyncio gRPC server factory shared by every tier: health checking, reflection, auth, trace
propagation, message-size limits and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from rlmesh.services.auth import TLSFiles, token_matches
from rlmesh.services.telemetry import extract_context, tracer

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Probes and discovery stay open so load balancers and grpcurl work without the token.
_PUBLIC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class _ServerInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the bearer token (UNAUTHENTICATED) and runs each call in a span
    continuing the caller's trace."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_PUBLIC_PREFIXES):
            return handler
        authorized = self._token is None or token_matches(details.invocation_metadata, self._token)
        parent = extract_context(details.invocation_metadata)
        return _wrap_handler(handler, method, authorized, parent)


def _wrap_handler(handler: grpc.RpcMethodHandler, method: str, authorized: bool, parent: Any):
    async def deny(context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{method}: missing or wrong bearer token; send 'authorization: Bearer <token>' "
            "with the shared token (network.token_file / $RLMESH_TOKEN)",
        )

    if handler.response_streaming:
        inner = handler.unary_stream or handler.stream_stream

        async def behaviour(request_or_iterator: Any, context: grpc.aio.ServicerContext):
            if not authorized:
                await deny(context)
            with tracer.start_as_current_span(method, context=parent):
                async for item in inner(request_or_iterator, context):
                    yield item
    else:
        inner = handler.unary_unary or handler.stream_unary

        async def behaviour(request_or_iterator: Any, context: grpc.aio.ServicerContext):
            if not authorized:
                await deny(context)
            with tracer.start_as_current_span(method, context=parent):
                return await inner(request_or_iterator, context)

    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class Server:
    """A started aio server plus its health servicer; `serve_forever` handles SIGTERM/SIGINT."""

    def __init__(self, server: grpc.aio.Server, port: int, health: HealthServicer, names: list[str]):
        self.server, self.port, self.health, self._names = server, port, health, names

    async def set_serving(self, serving: bool, *, names: list[str] | None = None) -> None:
        """Health of `names` (default: the whole server, "" included). Liveness probes ask for "",
        readiness probes for a service name, so a server can be alive but not ready."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (["", *self._names] if names is None else names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        # Fail health first so balancers stop routing, then let in-flight calls finish.
        await self.set_serving(False)
        await self.server.stop(grace_s)

    async def serve_forever(self, grace_s: float = 10.0, on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        waiter = asyncio.create_task(self.server.wait_for_termination())
        stopper = asyncio.create_task(stopping.wait())
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stopping.is_set():
            log.info("signal received: draining in-flight calls (grace %.0fs)", grace_s)
            if on_stop is not None:
                await on_stop()
            await self.stop(grace_s)
        waiter.cancel()
        stopper.cancel()


async def start_server(
    services: Iterable[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    tls: TLSFiles | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
) -> Server:
    """Start a server hosting `services` as (add_XServicer_to_server, servicer, full service name).
    Port 0 picks a free port; the bound port is `Server.port`."""
    server = grpc.aio.server(
        interceptors=[_ServerInterceptor(token)], options=channel_options(max_message_bytes)
    )
    names = []
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    )
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {address}; is the port in use?")
    await server.start()
    wrapped = Server(server, bound, health, names)
    await wrapped.set_serving(True)
    return wrapped
