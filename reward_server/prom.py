"""The reward server's Prometheus metrics (`rlmesh_reward_*`): every environment call (score,
reset, step, close) by environment, method and outcome, its latency, and the open sessions."""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

ENV_CALLS = Counter("rlmesh_reward_env_calls_total", "Environment calls by environment, method and outcome "
                    "(ok, error, timeout)", ["env", "method", "outcome"])
ENV_SECONDS = Histogram("rlmesh_reward_env_call_seconds", "Latency of an environment call (a Score batch, "
                        "a Reset, Step or Close)", ["env", "method"],
                        buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120))


class SessionCollector:
    def __init__(self, sessions: Sized) -> None:
        self.sessions = sessions

    def collect(self) -> Any:
        yield GaugeMetricFamily("rlmesh_reward_open_sessions", "Multi-turn sessions open on this server",
                                value=len(self.sessions))


def register(sessions: Sized) -> None:
    """Report the size of `sessions` (the service's session table) as the open-sessions gauge."""
    REGISTRY.register(SessionCollector(sessions))
