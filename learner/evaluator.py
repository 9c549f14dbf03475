"""Held-out evaluation through the rollout tier: one greedy completion per eval prompt, scored by
the environment. Accuracy is the environment's own correctness signal (its `correct` reward
component) where it reports one, and the mean reward otherwise (the record says which). An episode the
rollout tier cut off at `rollout.episode.max_turns` never got the environment's verdict: it counts as
not correct."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from learner.data import Example
from learner.issuer import PromptIssuer
from rlmesh.v1 import common_pb2
from services.queue import Entry, StreamQueue

log = logging.getLogger(__name__)

CORRECT = "correct"

Arrivals = list[tuple[Entry, common_pb2.TrajectoryGroup]]


CUT_OFF = "max_turns"  # the finish reason of an episode stopped by the rollout tier's turn budget


def correctness(sample: common_pb2.Sample) -> float:
    if CORRECT in sample.reward_components:
        return sample.reward_components[CORRECT]
    return 0.0 if sample.finish_reason == CUT_OFF else sample.reward


def reports_correctness(scored: list[common_pb2.Sample]) -> bool:
    """True when the environment gave a `correct` verdict on every episode it finished."""
    verdicts = [CORRECT in s.reward_components for s in scored if s.finish_reason != CUT_OFF]
    return bool(verdicts) and all(verdicts)


def episode_stats(samples: list[common_pb2.Sample]) -> dict[str, float]:
    """Mean turns and mean reward components (e.g. `num_tool_calls`) over samples; empty when none."""
    if not samples:
        return {}
    out = {"turns_mean": sum(s.num_turns for s in samples) / len(samples)}
    for key in sorted({k for s in samples for k in s.reward_components}):
        out[f"{key}_mean"] = sum(s.reward_components.get(key, 0.0) for s in samples) / len(samples)
    return out


class Evaluator:
    def __init__(self, eval_set: list[Example], issuer: PromptIssuer, trajectories: StreamQueue,
                 read: Callable[[], Awaitable[Arrivals]], between_reads: Callable[[], Awaitable[None]],
                 timeout_s: float = 600.0) -> None:
        self.eval_set, self.issuer, self.trajectories = eval_set, issuer, trajectories
        self.read, self.between_reads, self.timeout_s = read, between_reads, timeout_s

    async def run(self, version: int, held_back: Arrivals) -> dict:
        """Evaluate at `version`; train groups that arrive meanwhile are appended to `held_back`."""
        pending = set()
        for ex in self.eval_set:
            group = self.issuer.prompt_group(ex, "eval", 1, version, greedy=True)
            await self.issuer.publish(group)
            pending.add(group.group_id)
        t0, results = time.monotonic(), []
        while pending:
            await self.between_reads()
            for entry, group in await self.read():
                if group.group_id in pending:
                    pending.discard(group.group_id)
                    self.issuer.returned(group.group_id)
                    results.append(group.samples[0])
                    await self.trajectories.ack(entry.id)
                elif group.prompt.split == "train":
                    held_back.append((entry, group))
                else:  # an eval group of an earlier round (e.g. before a restart)
                    await self.trajectories.ack(entry.id)
            if time.monotonic() - t0 > self.timeout_s:
                raise TimeoutError(f"{len(pending)} eval groups not back after {self.timeout_s:.0f}s; "
                                   "is a rollout server running?")
        scored = [s for s in results if not s.error]
        has_signal = reports_correctness(scored)
        accuracy = sum(correctness(s) if has_signal else s.reward for s in scored) / max(len(results), 1)
        record = {"kind": "eval", "version": version, "accuracy": accuracy,
                  "accuracy_source": "env_correct" if has_signal else "mean_reward",
                  "reward_mean": sum(s.reward for s in scored) / max(len(scored), 1),
                  "num_prompts": len(results), "num_errors": len(results) - len(scored), **episode_stats(scored),
                  "eval_s": time.monotonic() - t0}
        log.info("held-out accuracy at version %d: %.3f (%d prompts)", version, accuracy, len(results))
        return record
