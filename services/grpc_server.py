"""Asyncio gRPC server factory shared by every tier: health checking, reflection, auth, trace
propagation, message-size limits and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from rlmesh.services.auth import ANY, Policy, TLSFiles, check_can_serve, peer_tier, token_matches
from rlmesh.services.telemetry import extract_context, tracer
from rlmesh.services.config import NetworkSection, default

if TYPE_CHECKING:
    from rlmesh.services.config import NetworkSection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Probes and discovery stay open so load balancers and grpcurl work without the token.
_PUBLIC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


@dataclass(frozen=True)
class ServerLimits:
    """Bounds a server enforces on every call; each refusal names its config key."""

    max_message_bytes: int = MAX_MESSAGE_BYTES
    message_key: str = "max_message_bytes"
    max_concurrent_rpcs: int | None = None
    max_metadata_bytes: int | None = None
    max_connection_age_s: float | None = None
    """Close each connection (GOAWAY) after this long, so that clients resolve the server's name again."""
    connection_age_grace_s: float = 60.0
    """How long calls in flight on such a connection may still run."""

    @classmethod
    def from_config(cls, network: NetworkSection, tier: str) -> ServerLimits:
        limits = network.limits
        mib = getattr(limits, f"{tier}_max_message_mib")
        return cls(mib * 1024 * 1024, f"network.limits.{tier}_max_message_mib={mib}",
                   limits.max_concurrent_rpcs, limits.max_metadata_kib * 1024)

    def options(self) -> list[tuple[str, Any]]:
        # gRPC's own check sits above ours, so that most oversized messages get our message, which
        # names the config key; it still bounds what a call can make the server buffer.
        options = channel_options(2 * self.max_message_bytes)
        if self.max_metadata_bytes is not None:
            options += [("grpc.max_metadata_size", self.max_metadata_bytes)]
        if self.max_connection_age_s is not None:
            options += [("grpc.max_connection_age_ms", int(self.max_connection_age_s * 1000)),
                        ("grpc.max_connection_age_grace_ms", int(self.connection_age_grace_s * 1000))]
        return options


class _ServerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call before its request is parsed: without the bearer token (UNAUTHENTICATED), from a
    tier the server's policy does not allow (PERMISSION_DENIED, mutual TLS only), past the server's
    concurrent-call limit or message size (RESOURCE_EXHAUSTED); then refuses a request that does not
    parse as the method's message (INVALID_ARGUMENT). Runs each call in a span continuing the
    caller's trace."""

    def __init__(self, token: str | None, policy: Policy | None, limits: ServerLimits, mutual_tls: bool) -> None:
        self._token, self._policy, self._limits, self._mutual = token, policy, limits, mutual_tls
        self.num_inflight = 0

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
        tiers = self._policy.allowed(method) if (self._policy is not None and self._mutual) else ANY
        parent = extract_context(details.invocation_metadata)
        return _wrap_handler(handler, method, self, authorized, tiers, parent)

    async def admit(self, method: str, context: grpc.aio.ServicerContext, authorized: bool,
                    tiers: frozenset[str] | None) -> None:
        """Abort the call unless it may run; counts it in flight when it may."""
        if not authorized:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method}: missing or wrong bearer token; send 'authorization: Bearer <token>' "
                "with the shared token (network.token_file / $RLMESH_TOKEN)")
        if tiers is not ANY:
            tier = peer_tier(context)
            if tier not in tiers:
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} may be called only by {', '.join(sorted(tiers))}; the caller's certificate "
                    f"names {tier!r} (its common name is its tier)")
        limit = self._limits.max_concurrent_rpcs
        if limit is not None and self.num_inflight >= limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method}: {self.num_inflight} calls already in flight on this server, the limit "
                f"network.limits.max_concurrent_rpcs={limit}; retry later or raise the limit")
        self.num_inflight += 1

    async def parse(self, raw: bytes, deserialize: Callable[[bytes], Any] | None, method: str,
                    context: grpc.aio.ServicerContext) -> Any:
        if len(raw) > self._limits.max_message_bytes:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method}: request of {len(raw)} bytes is over the limit {self._limits.message_key} "
                f"({self._limits.max_message_bytes} bytes); send smaller batches or raise the limit")
        if deserialize is None:
            return raw
        try:
            return deserialize(raw)
        except DecodeError as err:  # gRPC would answer UNKNOWN, which blames the server
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method}: the request ({len(raw)} bytes) does not parse ({err}); send the method's request "
                "message, serialized (are client and server built from the same rlmesh.v1 protos?)")


def _wrap_handler(handler: grpc.RpcMethodHandler, method: str, guard: _ServerInterceptor, authorized: bool,
                  tiers: frozenset[str] | None, parent: Any):
    """The handler behind the checks: it takes raw bytes and parses them only once the call is admitted."""
    deserialize = handler.request_deserializer

    async def request(raw_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        if not handler.request_streaming:
            return await guard.parse(raw_or_iterator, deserialize, method, context)

        async def parsed():
            async for raw in raw_or_iterator:
                yield await guard.parse(raw, deserialize, method, context)
        return parsed()

    if handler.response_streaming:
        inner = handler.unary_stream or handler.stream_stream

        async def behaviour(raw_or_iterator: Any, context: grpc.aio.ServicerContext):
            await guard.admit(method, context, authorized, tiers)
            try:
                req = await request(raw_or_iterator, context)
                with tracer.start_as_current_span(method, context=parent):
                    async for item in inner(req, context):
                        yield item
            finally:
                guard.num_inflight -= 1
    else:
        inner = handler.unary_unary or handler.stream_unary

        async def behaviour(raw_or_iterator: Any, context: grpc.aio.ServicerContext):
            await guard.admit(method, context, authorized, tiers)
            try:
                req = await request(raw_or_iterator, context)
                with tracer.start_as_current_span(method, context=parent):
                    return await inner(req, context)
            finally:
                guard.num_inflight -= 1

    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    # No request deserializer: the request arrives as bytes and is parsed only once admitted.
    return factory(behaviour, request_deserializer=None, response_serializer=handler.response_serializer)


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


BIND_RETRY_S = 10.0
"""How long a fixed port is retried: `rlmesh up` hands each service a port it found free, and until
the service binds it a local client dialling it (a tier waiting for the learner) can be given that very
port as its own source port (TCP connects to itself), holding it for a moment."""


async def _bind(server: grpc.aio.Server, address: str, tls: TLSFiles | None, retry_s: float) -> int:
    deadline = time.monotonic() + retry_s
    while True:
        try:
            bound = server.add_secure_port(address, tls.server_credentials()) if tls else \
                server.add_insecure_port(address)
        except RuntimeError:
            bound = 0
        if bound:
            return bound
        if time.monotonic() >= deadline:
            raise OSError(f"could not bind gRPC server to {address}; is the port in use? (give the service another "
                          "port, or 0 for any free one)")
        log.warning("port %s is busy; retrying", address)
        await asyncio.sleep(0.5)


async def start_server(
    services: Iterable[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    *,
    host: str = default(NetworkSection, "host"),
    port: int = 0,
    token: str | None = None,
    tls: TLSFiles | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    limits: ServerLimits | None = None,
    policy: Policy | None = None,
    insecure: bool = default(NetworkSection, "insecure"),
) -> Server:
    """Start a server hosting `services` as (add_XServicer_to_server, servicer, full service name).
    Port 0 picks a free port; the bound port is `Server.port`. Refuses (ValueError) to serve beyond
    loopback without a token or mutual TLS unless `insecure`; `policy` says which tiers may call
    what under mutual TLS; `limits` (default: only `max_message_bytes`) bound every call."""
    check_can_serve(host, token=token, tls=tls, insecure=insecure)
    limits = limits or ServerLimits(max_message_bytes)
    guard = _ServerInterceptor(token, policy, limits, mutual_tls=tls is not None and tls.mutual)
    # gRPC's own concurrency cap sits above ours (health probes count there too) as a backstop.
    backstop = None if limits.max_concurrent_rpcs is None else limits.max_concurrent_rpcs + 64
    server = grpc.aio.server(interceptors=[guard], options=limits.options(), maximum_concurrent_rpcs=backstop)
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
    bound = await _bind(server, address, tls, retry_s=BIND_RETRY_S if port else 0.0)
    await server.start()
    wrapped = Server(server, bound, health, names)
    await wrapped.set_serving(True)
    return wrapped
