"""The rollout server's Prometheus metrics (`rlmesh_rollout_*`): read from the generator and the
queue worker when scraped (a collector, so the hot path only bumps its own plain counters), and the
engine's running and waiting sequences and KV-cache use from a vLLM stat logger (engine stats are
collected only when the metrics endpoint is on; without vLLM's own series, only the scheduler's
numbers are, not vLLM's per-request statistics: `skip_request_stats`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rlmesh.services.config import LoggingSection, default

if TYPE_CHECKING:
    from rlmesh.rollout_server.generator import VLLMGenerator
    from rlmesh.rollout_server.worker import RolloutWorker

RUNNING = Gauge("rlmesh_rollout_running_sequences", "Sequences the vLLM scheduler is running")
WAITING = Gauge("rlmesh_rollout_waiting_sequences", "Sequences waiting in the vLLM scheduler")
KV_CACHE = Gauge("rlmesh_rollout_kv_cache_usage_ratio", "Fraction of the KV cache in use (0-1)")


class RolloutCollector:
    def __init__(self, generator: VLLMGenerator, worker: RolloutWorker) -> None:
        self.generator, self.worker = generator, worker

    def collect(self) -> Any:
        g, w = self.generator, self.worker
        yield CounterMetricFamily("rlmesh_rollout_generated_tokens", "Completion tokens generated",
                                  value=g.num_generated_tokens)
        yield CounterMetricFamily("rlmesh_rollout_engine_busy_seconds", "Seconds the engine had work and "
                                  "was not paused", value=g.busy.seconds)
        yield CounterMetricFamily("rlmesh_rollout_pause_seconds", "Seconds generation was paused for "
                                  "weight updates", value=g.paused_seconds)
        yield CounterMetricFamily("rlmesh_rollout_groups_completed", "Trajectory groups published",
                                  value=w.num_completed)
        samples = CounterMetricFamily("rlmesh_rollout_samples", "Samples and episodes finished, by "
                                      "finish reason", labels=["finish_reason"])
        for reason, n in sorted(w.finish_reasons.items()):
            samples.add_metric([reason], n)
        yield samples
        yield GaugeMetricFamily("rlmesh_rollout_groups_in_progress", "Prompt groups being generated here",
                                value=w.num_inflight)
        yield GaugeMetricFamily("rlmesh_rollout_policy_version", "Policy version of the served weights",
                                value=g.version)


def register(generator: VLLMGenerator, worker: RolloutWorker) -> None:
    """Serve this server's generator and worker numbers (the engine's stat logger, given to the
    engine at creation, is `engine_stats_logger`)."""
    REGISTRY.register(RolloutCollector(generator, worker))


def engine_stats_logger(vllm_metrics: bool = default(LoggingSection, "vllm_metrics")) -> Any:
    """A vLLM stat logger class copying the scheduler's numbers into the gauges above (vLLM is
    imported here, not at module import: the metrics module stays light).

    vLLM adds its own Prometheus logger (the `vllm:*` series: a dozen histograms observed per
    request and per engine step) beside any custom one, unless the custom one is a
    PrometheusStatLogger. On the small models the rollout tier often serves, that per-step
    bookkeeping is a measurable share of the front-end's CPU, so by default this logger takes its
    place (`logging.vllm_metrics: true` keeps vLLM's series as well)."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase

    def copy(scheduler_stats: Any) -> None:
        if scheduler_stats is not None:
            RUNNING.set(scheduler_stats.num_running_reqs)
            WAITING.set(scheduler_stats.num_waiting_reqs)
            KV_CACHE.set(scheduler_stats.kv_cache_usage)

    class EngineStats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            copy(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    class EngineStatsOnly(PrometheusStatLogger):
        """In place of vLLM's Prometheus logger: none of its series, only the three gauges above."""

        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            pass  # PrometheusStatLogger.__init__ would register the vllm:* series

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            copy(scheduler_stats)

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return EngineStats if vllm_metrics else EngineStatsOnly


def skip_request_stats(engine: Any) -> None:
    """Stop `engine`'s (an AsyncLLM's) front-end from keeping vLLM's per-request statistics.

    Any stat logger switches vLLM's statistics on in both the engine core (the scheduler's numbers
    each engine step, which `EngineStatsOnly` copies) and the front-end, which then updates an
    IterationStats for every request's every output and every finished request (latencies, token
    counts) that only vLLM's own series read. On the demo's short samples that per-request
    bookkeeping was ~7% of the front-end's CPU, on the core generation runs on: with
    `logging.vllm_metrics` off, the front-end skips it (LoRA request states included, which only
    those statistics keep)."""
    processor = engine.output_processor
    processor.lora_states.log_stats = False
    processor._update_stats_from_output = _skip
    processor._update_stats_from_finished = _skip


def _skip(*args: Any) -> None:
    pass
