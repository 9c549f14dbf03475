"""Logging, tracing and trace propagation of every service.

Logs: one line per event, as text or (`logging.format: json`) one JSON object per line with the
service, level, message, and the group id, policy version and trace id of the span it was logged
in. Traces: a tracer provider is installed only when something exports spans — OTLP when the SDK's
standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set, over
`OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf` by default, or `grpc`), and/or a JSONL file
`<run_dir>/traces/<service>-<pid>.jsonl` (`logging.trace_file`). Context crosses gRPC calls in the
metadata (W3C traceparent) and the queues in `trace_context` maps on the prompt and trajectory
messages, so one prompt group is one trace across the tiers."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opentelemetry import context, propagate, trace

from rlmesh.services.config import LoggingSection, default

_configured = False
RUN_DIR_ENV = "RLMESH_RUN_DIR"  # set by `rlmesh up` for every service it starts
GROUP_ID, VERSION = "rlmesh.group_id", "rlmesh.version"  # span attributes (and JSON log fields)


def setup_logging(service: str, level: str = default(LoggingSection, "level"), *, fmt: str = "text",
                  trace_file: bool = default(LoggingSection, "trace_file"),
                  run_dir: Path | None = None, sample_ratio: float = 1.0) -> logging.Logger:
    """Logs to stderr as `fmt` ("text" or "json"), and tracing (see the module docstring); the
    span file goes to `run_dir` (default $RLMESH_RUN_DIR) when `trace_file` is set."""
    global _configured
    if not _configured:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter(service) if fmt == "json" else
                             logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
                                               "%H:%M:%S"))
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(level)
        _configured = True
    run_dir = run_dir or (Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else None)
    setup_tracing(service, run_dir / "traces" / f"{service}-{os.getpid()}.jsonl" if trace_file and run_dir else None,
                  sample_ratio)
    return logging.getLogger(f"rlmesh.{service}")


class JsonFormatter(logging.Formatter):
    """One JSON object per record; `group_id`/`version` from the record's `extra`, else from the
    current span's attributes; `trace_id` from the current span."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": round(record.created, 3), "service": self.service,
                               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        span = trace.get_current_span()
        ctx = span.get_span_context()
        attrs = getattr(span, "attributes", None) or {}
        for key, attr in (("group_id", GROUP_ID), ("version", VERSION)):
            value = getattr(record, key, None)
            value = attrs.get(attr) if value is None else value
            if value is not None:
                out[key] = value
        if ctx.is_valid:
            out["trace_id"] = format(ctx.trace_id, "032x")
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_tracing(service: str, trace_file: Path | None = None, sample_ratio: float = 1.0) -> None:
    """A tracer provider named after the service, exporting over OTLP and/or to `trace_file`; with
    neither, none is installed (spans cost nothing, incoming context is still passed on).
    `sample_ratio` of the traces started here are recorded; a span with a parent from another tier
    follows the parent's decision, so a group is traced in every tier or in none. The SDK's
    OTEL_TRACES_SAMPLER (and _ARG) take precedence when set."""
    from opentelemetry.sdk.trace import TracerProvider

    otlp = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    if isinstance(trace.get_tracer_provider(), TracerProvider) or not (otlp or trace_file):
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    os.environ.setdefault("OTEL_SERVICE_NAME", service)
    provider = TracerProvider(resource=Resource.create({"service.name": service}), sampler=trace_sampler(sample_ratio))
    exporters: list[Any] = []
    if otlp:
        if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporters.append(OTLPSpanExporter())
    if trace_file is not None:
        exporters.append(JsonlSpanExporter(trace_file))
    # One batch processor (one queue, one export thread) hands each batch to every exporter: a
    # processor per exporter would queue every span twice, on the serving thread.
    provider.add_span_processor(BatchSpanProcessor(exporters[0] if len(exporters) == 1 else FanOutExporter(exporters)))
    trace.set_tracer_provider(provider)


def trace_sampler(ratio: float) -> Any:
    """Parent-based sampling of `ratio` of the traces started in this process; None (the SDK reads
    OTEL_TRACES_SAMPLER itself) when that variable is set."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    return None if os.environ.get("OTEL_TRACES_SAMPLER") else ParentBased(TraceIdRatioBased(ratio))


class JsonlSpanExporter:
    """Spans as one compact JSON object per line, appended to a file: name, context (trace and span
    id, hex as in the SDK's `to_json`), parent span id, kind, start and end (ns since the epoch),
    status, attributes and the service. (The SDK's `ReadableSpan.to_json` repeats the whole resource
    in every span and cost a tier about 1 ms a span.)"""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = [json.dumps(_span_record(span), default=str) + "\n" for span in spans]
        with self._lock:
            self._f.writelines(lines)
            self._f.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._f.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class FanOutExporter:
    """Exports each batch of spans to every one of `exporters`, in order; the batch fails if any
    exporter fails (each exporter retries on its own)."""

    def __init__(self, exporters: Sequence[Any]) -> None:
        self.exporters = list(exporters)

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        results = [exporter.export(spans) for exporter in self.exporters]
        ok = all(r == SpanExportResult.SUCCESS for r in results)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        for exporter in self.exporters:
            exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all([exporter.force_flush(timeout_millis) for exporter in self.exporters])


def _span_record(span: Any) -> dict[str, Any]:
    ctx, parent = span.context, span.parent
    return {"name": span.name,
            "context": {"trace_id": f"0x{ctx.trace_id:032x}", "span_id": f"0x{ctx.span_id:016x}"},
            "parent_id": f"0x{parent.span_id:016x}" if parent is not None else None,
            "kind": span.kind.name, "start_time": span.start_time, "end_time": span.end_time,
            "status": span.status.status_code.name, "attributes": dict(span.attributes or {}),
            "service": span.resource.attributes.get("service.name")}


@contextmanager
def group_span(name: str, group_id: str, parent: Mapping[str, str] | None = None,
               carrier: MutableMapping[str, str] | None = None, **attributes: Any) -> Iterator[Any]:
    """A span of one prompt group's work: a child of the context in `parent` (a message's
    `trace_context`) when given, else of the current span; its own context is written into
    `carrier` (the outgoing message's `trace_context`)."""
    ctx = propagate.extract(dict(parent)) if parent else None
    attrs = {GROUP_ID: group_id, **{f"rlmesh.{k}": v for k, v in attributes.items()}}
    with tracer.start_as_current_span(name, context=ctx, attributes=attrs) as span:
        if carrier is not None:
            propagate.inject(carrier)
        yield span


def record_span(name: str, group_id: str, parent: Mapping[str, str], start_ns: int, end_ns: int,
                **attributes: Any) -> None:
    """A finished span of a group's work, timed after the fact (the train step its group was in)."""
    if not parent:
        return
    attrs = {GROUP_ID: group_id, **{f"rlmesh.{k}": v for k, v in attributes.items()}}
    span = tracer.start_span(name, context=propagate.extract(dict(parent)), attributes=attrs, start_time=start_ns)
    span.end(end_time=end_ns)


def inject_metadata(metadata: Sequence[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """Metadata plus the current trace context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(metadata or ()) + list(carrier.items())


def extract_context(metadata: Sequence[tuple[str, str | bytes]] | None) -> context.Context:
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


tracer = trace.get_tracer("rlmesh")
