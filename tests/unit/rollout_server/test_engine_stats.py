"""The rollout server's vLLM stat logger: it stands in for vLLM's Prometheus logger unless
`logging.vllm_metrics` asks for vLLM's own series too."""

import pytest


def test_the_rollout_engine_logger_replaces_vllms_prometheus_series_unless_asked_for():
    pytest.importorskip("vllm")
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from rlmesh.rollout_server.prom import RUNNING, WAITING, engine_stats_logger

    only, both = engine_stats_logger(vllm_metrics=False), engine_stats_logger(vllm_metrics=True)
    # vLLM adds its own PrometheusStatLogger unless a custom logger is one
    assert issubclass(only, PrometheusStatLogger) and not issubclass(both, PrometheusStatLogger)

    class Stats:
        num_running_reqs, num_waiting_reqs, kv_cache_usage = 5, 2, 0.25

    logger = only(None, [0])
    logger.record(Stats(), None)
    logger.record(None, None)  # an output batch without scheduler stats leaves the gauges alone
    assert (RUNNING._value.get(), WAITING._value.get()) == (5, 2)
