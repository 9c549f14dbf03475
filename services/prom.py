"""Prometheus metrics endpoint of a service: `/metrics` over HTTP on network.host (loopback by
default) at `logging.metrics_port` (0: any free port), and the chosen port written to
`<run_dir>/metrics_ports/<name>.json` so a scraper (or a test) can find it. The endpoint serves
counters and gauges only: no config, no token, no data. Each tier defines its metrics next to its
code (`rlmesh_<tier>_...`, Prometheus' naming: `_total` counters, `_seconds` base units)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rlmesh.services.telemetry import RUN_DIR_ENV

if TYPE_CHECKING:
    from rlmesh.services.config import RunConfig

log = logging.getLogger("rlmesh.prom")


def serve_metrics(config: RunConfig, tier: str, name: str | None = None, run_dir: Path | None = None) -> int | None:
    """Start the metrics endpoint (a daemon thread) if `logging.metrics_port` is set; the port, or
    None when off. `run_dir` defaults to $RLMESH_RUN_DIR; without one the port is only logged."""
    port, name = config.logging.metrics_port, name or tier
    if port is None:
        return None
    host = config.network.host
    server = metrics_server(host, port)
    port = server.server_port
    run_dir = run_dir or (Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else None)
    if run_dir is not None:
        folder = run_dir / "metrics_ports"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{safe_name(name)}.json"
        path.write_text(json.dumps({"service": name, "tier": tier, "host": host, "port": port, "pid": os.getpid()}))
    log.info("prometheus metrics of %s on http://%s:%d/metrics", name, host, port)
    return port


MAX_CONNECTIONS = 16
"""Connections the /metrics endpoint serves at once; one more is closed at once (a scraper needs one)."""
IDLE_S = 10.0
"""A connection that sends nothing for this long is dropped (a stranger holding sockets open ties up nothing)."""


def metrics_server(host: str, port: int):
    """prometheus_client's /metrics app on a threaded HTTP server (a daemon thread) that is bounded,
    unlike its own `start_http_server`: at most MAX_CONNECTIONS at a time, each dropped after IDLE_S
    of silence, so many or idle connections from whoever reaches the port cannot pile up threads in
    the service. Returns the server (`server_port`: the port bound; `shutdown()` stops it)."""
    import socket
    import sys
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    class Handler(WSGIRequestHandler):
        timeout = IDLE_S

        def log_message(self, format: str, *args) -> None:  # one line per scrape would flood the log
            pass

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        request_queue_size = 64  # connections the kernel holds until accepted (socketserver's default: 5)
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        def process_request(self, request, client_address) -> None:
            if not self.slots.acquire(blocking=False):
                self.shutdown_request(request)  # full: this one is closed, the ones being served go on
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self.slots.release()
                raise

        def process_request_thread(self, request, client_address) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

        def handle_error(self, request, client_address) -> None:
            if not isinstance(sys.exc_info()[1], OSError):  # a dropped or timed-out peer is no error of ours
                log.warning("/metrics request from %s failed", client_address[0], exc_info=True)

    server = make_server(host, port, make_wsgi_app(), Server, handler_class=Handler)
    threading.Thread(target=server.serve_forever, name="rlmesh-metrics", daemon=True).start()
    return server


def safe_name(name: str) -> str:
    """A service name (a rollout server id may be `host:port`) as a file name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def read_ports(run_dir: Path) -> dict[str, dict]:
    """The metrics endpoints the services of a run wrote: name -> {"host", "port", "pid"}."""
    folder = run_dir / "metrics_ports"
    if not folder.is_dir():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
