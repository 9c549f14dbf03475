"""The learner's Prometheus metrics (`rlmesh_learner_*`), fed from the same records the controller
writes to metrics.jsonl (this is a tracker like the others), plus a poller for what no record
holds: queue length and lag per stream, and groups issued."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from pathlib import Path

    from rlmesh.learner.rl.issuer import PromptIssuer
    from rlmesh.services.queue import StreamQueue

log = logging.getLogger("rlmesh.learner")
VERSION = Gauge("rlmesh_learner_policy_version", "Policy version (optimizer steps taken)")
STEP_PHASE = Histogram("rlmesh_learner_step_phase_seconds", "Seconds of one training step by phase "
                       "(step: the whole step; train: forward/backward/optimizer; broadcast: the weight update)",
                       ["phase"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
WEIGHT_UPDATE = Histogram("rlmesh_learner_weight_update_phase_seconds", "Seconds of a weight broadcast by phase",
                          ["phase"], buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120))
STALENESS = Histogram("rlmesh_learner_staleness_versions", "Versions between a trained group's generation and "
                      "the policy it trained", buckets=(0, 1, 2, 3, 4, 6, 8, 16))
GROUPS_ISSUED = Gauge("rlmesh_learner_groups_issued", "Prompt groups issued by this learner process")
GROUPS_TRAINED = Counter("rlmesh_learner_groups_trained_total", "Trajectory groups trained on")
GROUPS_DROPPED = Counter("rlmesh_learner_groups_dropped_total", "Trajectory groups dropped, by reason",
                         ["reason"])
IN_FLIGHT = Gauge("rlmesh_learner_groups_in_flight", "Prompt groups issued and not yet back")
QUEUE_LENGTH = Gauge("rlmesh_queue_length", "Entries in a stream (the unacked backlog)", ["stream"])
QUEUE_LAG = Gauge("rlmesh_queue_lag", "Entries of a stream its consumer group has not read yet", ["stream"])
MISMATCH_KL = Gauge("rlmesh_learner_mismatch_kl", "KL between the rollout's and the learner's logprobs of the last step")
REWARD = Gauge("rlmesh_learner_reward_mean", "Mean train reward of the last step")
TOKENS = Counter("rlmesh_learner_trained_tokens_total", "Completion tokens trained on")
EVAL_ACCURACY = Gauge("rlmesh_learner_eval_accuracy", "Held-out accuracy of the last evaluation")
# metrics.jsonl's cumulative drop counters -> the reason label
DROP_REASONS = {"num_dropped_stale": "stale", "num_dropped_other": "other", "num_dropped_invalid": "invalid",
                "num_duplicates": "duplicate"}


class PrometheusTracker:
    """Turns each metrics record into the learner's Prometheus metrics; with `poll` started, also
    polls the queues until closed."""

    def __init__(self) -> None:
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._poller: asyncio.Task | None = None

    def poll(self, issuer: PromptIssuer, streams: dict[str, StreamQueue]) -> None:
        self._poller = asyncio.create_task(poll_queues(issuer, streams), name="metrics-poller")
        self._poller.add_done_callback(_report)

    def log(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "eval":
            EVAL_ACCURACY.set(record.get("accuracy", 0.0))
        if record.get("kind") != "train":
            return
        VERSION.set(record["version"])
        for phase in ("step", "train", "broadcast"):
            if f"{phase}_s" in record:
                STEP_PHASE.labels(phase).observe(record[f"{phase}_s"])
        for key, value in record.items():
            if key.startswith("broadcast_") and key.endswith("_s"):
                WEIGHT_UPDATE.labels(key.removeprefix("broadcast_").removesuffix("_s")).observe(value)
        for age, n in record.get("staleness_counts", {}).items():
            for _ in range(n):
                STALENESS.observe(int(age))
        GROUPS_TRAINED.inc(record["num_groups"])
        TOKENS.inc(record["num_tokens"])
        for key, reason in DROP_REASONS.items():
            # cumulative in the record (restored on resume): count what is new since the last step
            if record.get(key, 0) > self._dropped[key]:
                GROUPS_DROPPED.labels(reason).inc(record[key] - self._dropped[key])
                self._dropped[key] = record[key]
        IN_FLIGHT.set(record["in_flight"])
        REWARD.set(record["reward_mean"])
        if "mismatch_kl" in record:
            MISMATCH_KL.set(record["mismatch_kl"])

    def log_image(self, name: str, path: Path, step: int) -> None:
        pass

    def close(self) -> None:
        # Stopped with the metrics writer, while the loop still runs: a queue call cancelled only
        # at the loop's teardown could keep it from ever closing.
        if self._poller is not None:
            self._poller.cancel()


def _report(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s failed: %r", task.get_name(), task.exception(), exc_info=task.exception())


async def poll_queues(issuer: PromptIssuer, streams: dict[str, StreamQueue], period_s: float = 2.0) -> None:
    """Queue length and lag per stream, groups issued and in flight, every `period_s` (a queue
    server that is down leaves the last values: the queue's own retries report it)."""
    from rlmesh.services.queue import QueueUnavailable

    while True:
        for name, queue in streams.items():
            try:
                depth = await asyncio.wait_for(queue.depth(), period_s * 5)
            except (QueueUnavailable, TimeoutError):
                continue
            QUEUE_LENGTH.labels(name).set(depth.length)
            QUEUE_LAG.labels(name).set(depth.lag)
        GROUPS_ISSUED.set(issuer.num_issued)
        IN_FLIGHT.set(issuer.ledger.in_flight)
        await asyncio.sleep(period_s)
