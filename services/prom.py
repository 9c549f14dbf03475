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
    from prometheus_client import start_http_server

    host = config.network.host
    server, _thread = start_http_server(port, addr=host)
    port = server.server_port
    run_dir = run_dir or (Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else None)
    if run_dir is not None:
        folder = run_dir / "metrics_ports"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{safe_name(name)}.json"
        path.write_text(json.dumps({"service": name, "tier": tier, "host": host, "port": port, "pid": os.getpid()}))
    log.info("prometheus metrics of %s on http://%s:%d/metrics", name, host, port)
    return port


def safe_name(name: str) -> str:
    """A service name (a rollout server id may be `host:port`) as a file name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def read_ports(run_dir: Path) -> dict[str, dict]:
    """The metrics endpoints the services of a run wrote: name -> {"host", "port", "pid"}."""
    folder = run_dir / "metrics_ports"
    if not folder.is_dir():
        return {}
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
