"""Logging setup and OpenTelemetry trace propagation through gRPC metadata (W3C traceparent)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

_configured = False


def setup_logging(service: str, level: str = "INFO") -> logging.Logger:
    """One readable line per event: time, service, level, logger, message."""
    global _configured
    if not _configured:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(level)
        _configured = True
    setup_tracing(service)
    return logging.getLogger(f"rlmesh.{service}")


def setup_tracing(service: str) -> None:
    """A tracer provider named after the service; exporters are added by the deployment
    (OTEL_* environment variables are honoured by the SDK's own exporters when installed)."""
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    trace.set_tracer_provider(provider)
    os.environ.setdefault("OTEL_SERVICE_NAME", service)


def inject_metadata(metadata: Sequence[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """Metadata plus the current trace context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(metadata or ()) + list(carrier.items())


def extract_context(metadata: Sequence[tuple[str, str | bytes]] | None) -> context.Context:
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


tracer = trace.get_tracer("rlmesh")
