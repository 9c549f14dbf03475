"""Everything observable on, checked on a live `rlmesh up` run (the main demo run in test_mesh.py
carries it): the spans of one prompt group from the learner, rollout and reward processes reach a
real OTLP/HTTP receiver under one trace id; a real Prometheus server (Debian's `prometheus` package)
scrapes every tier's endpoint (ports found in the run directory) and its query API shows the
learner's version, queue lag and the rollout tokens/s moving; logs are JSON lines; TensorBoard gets
the step metrics through the learner."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import warnings
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

OVERRIDES = ("logging.metrics_port=0", "logging.format=json", "logging.trace_file=true",
             "logging.trackers=[jsonl,tensorboard]")
"""What a run needs on for these checks."""


class Receiver(ThreadingHTTPServer):
    """The OTLP/HTTP trace endpoint (`POST /v1/traces`, protobuf), keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for rs in request.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        attrs = {a.key: a.value.string_value or a.value.int_value for a in span.attributes}
                        self.server.spans.append({"service": service, "name": span.name,
                                                  "trace_id": span.trace_id.hex(), "attributes": attrs})
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


def _scrape(port: int) -> dict[str, float]:
    """A /metrics page as {name{labels}: value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


QUERIES = ("rlmesh_learner_policy_version", 'rlmesh_queue_lag{stream="prompts"}',
           "rlmesh_rollout_generated_tokens_total", "rate(rlmesh_rollout_generated_tokens_total[10s])")


def _ports(run_dir) -> dict[str, int]:
    folder = run_dir / "metrics_ports"
    return {json.loads(p.read_text())["tier"]: json.loads(p.read_text())["port"] for p in folder.glob("*.json")} \
        if folder.is_dir() else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prometheus(tmp_path, ports: dict[str, int]) -> tuple[subprocess.Popen, int]:
    """A Prometheus server scraping the tiers every second; its port."""
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": tier, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]} for tier, port in ports.items()]}
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = _free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"))
    return proc, port


def _query(port: int, expr: str) -> float | None:
    """One instant query through Prometheus' HTTP API (None: no series yet, or not up)."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        result = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]
    except OSError:
        return None
    return float(result[0]["value"][1]) if result else None


def prometheus_available() -> bool:
    """Whether Debian's prometheus is here. Where it is missing on a machine that could install it (root,
    apt), that is a failure (`make test-tools` installs it); elsewhere the endpoints are checked alone,
    with a warning saying Prometheus' view is not."""
    if shutil.which("prometheus"):
        return True
    if os.geteuid() == 0 and shutil.which("apt-get"):
        raise AssertionError("Debian's prometheus is not installed (make test-tools installs it)")
    warnings.warn("no prometheus binary and no way to install one here (not root, or no apt): the metrics "
                  "endpoints are checked, Prometheus' view of them is not")
    return False


class Observer:
    """The OTLP receiver and (where Debian's prometheus is installed) a Prometheus server watching
    one run: `start` before the run, `watch` while it trains, `check` after it ended."""

    def __init__(self, monkeypatch, tmp_path) -> None:
        self.tmp_path = tmp_path
        self.receiver = Receiver()
        threading.Thread(target=self.receiver.serve_forever, daemon=True).start()
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{self.receiver.server_port}")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        self.prometheus: subprocess.Popen | None = None
        self.seen: dict = {}

    def watch(self, up, run_dir) -> None:
        """While the run trains: every tier's endpoint, and Prometheus' view of them, move."""
        up.wait_for(lambda: set(_ports(run_dir)) == {"learner", "rollout", "reward"}, 400, "three metrics endpoints")
        ports = _ports(run_dir)
        up.wait_for(lambda: _scrape(ports["learner"]).get("rlmesh_learner_policy_version", 0) >= 1, 400, "step 1")
        prom_port = None
        if prometheus_available():
            self.prometheus, prom_port = _prometheus(self.tmp_path, ports)
            up.wait_for(lambda: (_query(prom_port, "rlmesh_learner_policy_version") or 0) >= 1
                        and None not in [_query(prom_port, e) for e in QUERIES], 300, "every series in Prometheus")
        first = {tier: _scrape(port) for tier, port in ports.items()}
        q1 = {e: _query(prom_port, e) for e in QUERIES} if prom_port else {}
        later: dict = {"q": {}}

        def moved() -> bool:
            # the learner's version and the rollout's token counter move at their own times (generation runs
            # ahead of training by up to max_staleness versions): wait until both have, in Prometheus and on
            # the endpoints
            try:
                later["scrape"] = {tier: _scrape(port) for tier, port in ports.items()}
            except OSError:  # a tier restarting or already gone: the wait's own checks say which
                return False
            scrape = later["scrape"]
            endpoints_moved = scrape["learner"]["rlmesh_learner_policy_version"] > \
                first["learner"]["rlmesh_learner_policy_version"] and \
                scrape["rollout"]["rlmesh_rollout_generated_tokens_total"] > \
                first["rollout"]["rlmesh_rollout_generated_tokens_total"]
            if prom_port is None:
                return endpoints_moved
            later["q"] = q = {e: _query(prom_port, e) for e in QUERIES}
            return endpoints_moved and None not in q.values() and \
                q["rlmesh_learner_policy_version"] > q1["rlmesh_learner_policy_version"] and \
                q["rlmesh_rollout_generated_tokens_total"] > q1["rlmesh_rollout_generated_tokens_total"]

        up.wait_for(moved, 300, "a later step and more generated tokens in Prometheus")
        self.seen = {"q1": q1, "first": first, "q2": later["q"], "second": later["scrape"]}

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.terminate()
            self.prometheus.wait(10)

    def check(self, run_dir, num_steps: int) -> None:
        """After the run: what Prometheus and the endpoints showed, the spans, the logs, TensorBoard."""
        q1, first, q2, second = (self.seen[k] for k in ("q1", "first", "q2", "second"))
        if q1:  # Prometheus' view (where it could run)
            assert None not in q2.values(), q2
            assert q2["rlmesh_rollout_generated_tokens_total"] > q1["rlmesh_rollout_generated_tokens_total"]
            assert q2["rate(rlmesh_rollout_generated_tokens_total[10s])"] > 0  # rollout tokens/s
        assert second["learner"]["rlmesh_learner_policy_version"] > first["learner"]["rlmesh_learner_policy_version"]
        assert second["rollout"]["rlmesh_rollout_generated_tokens_total"] > \
            first["rollout"]["rlmesh_rollout_generated_tokens_total"]
        assert 'rlmesh_queue_lag{stream="prompts"}' in second["learner"]
        assert any(k.startswith("rlmesh_learner_staleness_versions_bucket") for k in second["learner"])
        assert "rlmesh_rollout_running_sequences" in second["rollout"]  # from the engine's scheduler stats
        assert not [k for k in second["rollout"] if k.startswith("vllm:")]  # vLLM's own series: logging.vllm_metrics
        assert 'rlmesh_rollout_samples_total{finish_reason="stop"}' in second["rollout"] or \
            'rlmesh_rollout_samples_total{finish_reason="length"}' in second["rollout"]
        calls = {k: v for k, v in second["reward"].items() if k.startswith("rlmesh_reward_env_calls_total")}
        assert any('outcome="ok"' in k and v > 0 for k, v in calls.items()), calls

        time.sleep(1.0)  # the last batches of spans (exported every 200 ms)
        with self.receiver.lock:
            spans = list(self.receiver.spans)
        self.receiver.shutdown()
        by_trace: dict[str, list[dict]] = defaultdict(list)
        for span in spans:
            by_trace[span["trace_id"]].append(span)
        trained = [s for s in spans if s["name"] == "train" and s["service"] == "learner"]
        assert trained, sorted({(s["service"], s["name"]) for s in spans})
        group_trace = by_trace[trained[0]["trace_id"]]
        seen = {(s["service"], s["name"]) for s in group_trace}
        assert {("learner", "issue"), ("rollout", "generate"), ("rollout", "score"), ("learner", "train")} <= seen, seen
        assert any(service == "reward" for service, _ in seen), seen  # the Score RPC, served in the reward process
        assert {s["attributes"]["rlmesh.group_id"] for s in group_trace if "rlmesh.group_id" in s["attributes"]} == \
            {trained[0]["attributes"]["rlmesh.group_id"]}
        assert list((run_dir / "traces").glob("learner-*.jsonl"))  # logging.trace_file

        lines = [json.loads(line) for line in (run_dir / "logs" / "learner.log").read_text().splitlines()
                 if line.startswith("{")]
        assert any(r["service"] == "learner" and r["message"].startswith("step ") for r in lines)

        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
        assert [e.step for e in events.Scalars("train/reward_mean")] == list(range(1, num_steps + 1))
