"""The Prometheus endpoint helper (port file, /metrics over HTTP), JSON log lines carrying the
span's group id, version and trace id, the JSONL span exporter, and one batch of spans going to
every exporter (OTLP and the trace file) from one queue."""

import io
import json
import logging
import urllib.request

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from rlmesh.services.config import RunConfig
from rlmesh.services.prom import read_ports, serve_metrics
from rlmesh.services.telemetry import GROUP_ID, VERSION, FanOutExporter, JsonFormatter, JsonlSpanExporter


def test_metrics_endpoint_on_a_free_port_is_written_to_the_run_dir(tmp_path):
    assert serve_metrics(RunConfig(), "learner", run_dir=tmp_path) is None  # off by default
    config = RunConfig.model_validate({"logging": {"metrics_port": 0}})
    port = serve_metrics(config, "rollout", "rollout-0:1", run_dir=tmp_path)
    ports = read_ports(tmp_path)
    assert ports["rollout-0_1"]["port"] == port and ports["rollout-0_1"]["tier"] == "rollout"
    assert ports["rollout-0_1"]["host"] == "127.0.0.1"  # network.host: loopback unless configured
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "python_info" in body


def test_the_metrics_endpoint_bounds_what_a_stranger_can_hold_open(monkeypatch):
    """Many idle connections neither pile up threads in the service nor hold it forever: past
    MAX_CONNECTIONS a connection is closed at once, and an idle one is dropped after IDLE_S."""
    import socket
    import threading
    import time

    from rlmesh.services import prom

    monkeypatch.setattr(prom, "IDLE_S", 1.0)
    server = prom.metrics_server("127.0.0.1", 0)
    port = server.server_port
    try:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(prom.MAX_CONNECTIONS)]
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert extra.recv(100) == b""  # closed unanswered: every slot is taken
        assert threading.active_count() - before <= prom.MAX_CONNECTIONS
        time.sleep(1.5)  # the idle ones are dropped ...
        assert all(s.recv(100) == b"" for s in idle)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "python_info" in body  # ... and a scrape is served again
    finally:
        server.shutdown()


def test_json_logs_carry_the_span_group_id_version_and_trace_id(tmp_path):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("rollout"))
    logger = logging.getLogger("rlmesh.test.jsonlogs")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    provider = TracerProvider()
    exporter = JsonlSpanExporter(tmp_path / "traces" / "rollout.jsonl")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    logger.warning("outside any span")
    with tracer.start_as_current_span("generate", attributes={GROUP_ID: "run/train/1/a", VERSION: 3}) as span:
        logger.info("group %s done", "a")
        trace_id = format(span.get_span_context().trace_id, "032x")
    logger.error("explicit", extra={"group_id": "g2", "version": 7})
    provider.shutdown()
    first, inside, explicit = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert first == {"time": first["time"], "service": "rollout", "level": "WARNING",
                     "logger": "rlmesh.test.jsonlogs", "message": "outside any span"}
    assert (inside["group_id"], inside["version"], inside["trace_id"], inside["message"]) == \
        ("run/train/1/a", 3, trace_id, "group a done")
    assert (explicit["group_id"], explicit["version"]) == ("g2", 7)
    spans = [json.loads(line) for line in (tmp_path / "traces" / "rollout.jsonl").read_text().splitlines()]
    assert [(s["name"], s["context"]["trace_id"], s["attributes"][GROUP_ID]) for s in spans] == \
        [("generate", "0x" + trace_id, "run/train/1/a")]


def test_trace_sampling_is_decided_where_a_trace_starts_and_followed_downstream(monkeypatch):
    from opentelemetry import propagate

    from rlmesh.services.telemetry import trace_sampler

    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    none, every = TracerProvider(sampler=trace_sampler(0.0)), TracerProvider(sampler=trace_sampler(1.0))
    with every.get_tracer("t").start_as_current_span("issue") as root:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # a sampled group's context, as the learner writes it into a prompt
        assert root.is_recording() and int(carrier["traceparent"][-2:], 16) & 1  # the sampled flag
    assert not none.get_tracer("t").start_span("issue").is_recording()  # ratio 0: roots not traced
    # ...but a tier at ratio 0 still records a group whose trace was sampled where it started
    assert none.get_tracer("t").start_span("generate", context=propagate.extract(carrier)).is_recording()
    unsampled = {"traceparent": carrier["traceparent"][:-2] + "00"}  # a group not sampled where it started
    assert not every.get_tracer("t").start_span("generate", context=propagate.extract(unsampled)).is_recording()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    assert trace_sampler(1.0) is None  # the SDK's own variable wins


class _Failing:
    def __init__(self) -> None:
        self.num_exported, self.closed = 0, False

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.num_exported += len(spans)
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.closed = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def test_one_batch_processor_hands_every_span_to_every_exporter(tmp_path):
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory, failing = InMemorySpanExporter(), _Failing()
    fan_out = FanOutExporter([memory, failing, JsonlSpanExporter(tmp_path / "t.jsonl")])
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(fan_out))
    tracer = provider.get_tracer("test")
    for name in ("issue", "generate", "score"):
        with tracer.start_as_current_span(name, attributes={GROUP_ID: "g"}):
            pass
    assert provider.force_flush()
    assert [s.name for s in memory.get_finished_spans()] == ["issue", "generate", "score"]
    assert [json.loads(line)["name"] for line in (tmp_path / "t.jsonl").read_text().splitlines()] == \
        ["issue", "generate", "score"]
    assert failing.num_exported == 3  # one exporter failing keeps none of the others from its spans
    assert fan_out.export(memory.get_finished_spans()) == SpanExportResult.FAILURE
    provider.shutdown()
    assert failing.closed
