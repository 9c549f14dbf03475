"""The rollout server's vLLM stat logger: it stands in for vLLM's Prometheus logger unless
`logging.vllm_metrics` asks for vLLM's own series too, and the front-end then skips vLLM's
per-request statistics."""

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


def test_the_front_end_skips_vllms_per_request_statistics():
    pytest.importorskip("vllm")
    import inspect
    from types import SimpleNamespace

    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats

    from rlmesh.rollout_server.prom import skip_request_stats

    # The vLLM internals skip_request_stats replaces: process_outputs calls both per output, with
    # the iteration's stats (a vLLM upgrade that moves them fails here, not silently in production)
    source = inspect.getsource(OutputProcessor.process_outputs)
    assert "self._update_stats_from_output(" in source and "self._update_stats_from_finished(" in source
    assert list(inspect.signature(OutputProcessor._update_stats_from_output).parameters) == \
        ["self", "req_state", "engine_core_output", "engine_core_timestamp", "iteration_stats"]
    assert list(inspect.signature(OutputProcessor._update_stats_from_finished).parameters) == \
        ["self", "req_state", "finish_reason", "iteration_stats"]

    processor = OutputProcessor(None, log_stats=True)
    skip_request_stats(SimpleNamespace(output_processor=processor))
    stats = IterationStats()
    processor._update_stats_from_output(None, None, None, stats)  # the real ones would fail on these
    processor._update_stats_from_finished(None, None, stats)
    assert (stats.num_generation_tokens, stats.finished_requests) == (0, [])
    assert not processor.lora_states.log_stats
    assert OutputProcessor(None, log_stats=True).lora_states.log_stats  # the class itself is untouched
