"""Held-out evaluation through the rollout tier: one greedy completion per eval prompt, scored by
the environment. Accuracy is the environment's own correctness signal (its `correct` reward
component) where it reports one, and the mean reward otherwise (the record says which). An episode the
rollout tier cut off at `rollout.episode.max_turns` never got the environment's verdict: it counts as
not correct."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rlmesh.learner.data import Example
from rlmesh.learner.issuer import PromptIssuer
from rlmesh.v1 import common_pb2
from rlmesh.services.queue import Entry, StreamQueue

log = logging.getLogger(__name__)

CORRECT = "correct"

Arrivals = list[tuple[Entry, common_pb2.TrajectoryGroup]]


CUT_OFF = "max_turns"  # the finish reason of an episode stopped by the rollout tier's turn budget


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


@dataclass
class Round:
    """One evaluation of the eval set, started at `version`."""

    version: int
    size: int  # eval groups issued
    t0: float = field(default_factory=time.monotonic)
    results: list[common_pb2.Sample] = field(default_factory=list)
    record: dict | None = None  # set when the last group is back


class Evaluator:
    """Rounds are started (`start`) and completed by the eval groups offered back to them (`offer`),
    so a round can finish while the learner trains (the controller offers what it reads); `run` is
    the blocking form, which also finishes every round still open. A finished round's record goes
    to `on_record`."""

    def __init__(self, eval_set: list[Example], issuer: PromptIssuer, trajectories: StreamQueue,
                 read: Callable[[], Awaitable[Arrivals]], between_reads: Callable[[], Awaitable[None]],
                 on_record: Callable[[dict], None], *, check: Callable[[common_pb2.TrajectoryGroup], str],
                 timeout_s: float = 600.0) -> None:
        """`check` says why an eval group of an open round is malformed (or ""): such a group
        counts in its round as a failed answer."""
        self.eval_set, self.issuer, self.trajectories = eval_set, issuer, trajectories
        self.read, self.between_reads, self.on_record = read, between_reads, on_record
        self.check = check
        self.timeout_s = timeout_s
        self.rounds: dict[str, Round] = {}  # eval group id -> its open round

    async def start(self, version: int) -> Round:
        rnd = Round(version, len(self.eval_set))
        for ex in self.eval_set:
            group = self.issuer.prompt_group(ex, "eval", 1, version, greedy=True)
            await self.issuer.publish(group)
            self.rounds[group.group_id] = rnd
        if not self.eval_set:
            self._finish(rnd)
        return rnd

    async def offer(self, entry: Entry, group: common_pb2.TrajectoryGroup) -> dict | None:
        """An eval group read from the trajectory stream: acked, and counted in its round; returns
        the round's record if this completed it. Groups of no open round (e.g. issued before a
        restart, or forged) are only acked; a malformed one is a failed answer."""
        await self.trajectories.ack(entry.id)
        rnd = self.rounds.get(group.group_id)
        if rnd is None:
            return None
        reason = self.check(group)
        del self.rounds[group.group_id]
        self.issuer.returned(group.group_id)
        rnd.results.append(common_pb2.Sample(error=f"dropped: {reason}") if reason else group.samples[0])
        return self._finish(rnd) if len(rnd.results) == rnd.size else None

    async def run(self, version: int, held_back: Arrivals) -> dict:
        """Evaluate at `version` and wait for it (and any round still open); train groups that
        arrive meanwhile are appended to `held_back`."""
        rnd = await self.start(version)
        while self.rounds:
            await self.between_reads()
            for entry, group in await self.read():
                if group.prompt.split == "train":
                    held_back.append((entry, group))
                else:
                    await self.offer(entry, group)
            if time.monotonic() - rnd.t0 > self.timeout_s:
                raise TimeoutError(f"{len(self.rounds)} eval groups not back after {self.timeout_s:.0f}s; "
                                   "is a rollout server running?")
        assert rnd.record is not None
        return rnd.record

    def _finish(self, rnd: Round) -> dict:
        rnd.record = self._record(rnd)
        self.on_record(rnd.record)
        return rnd.record

    @staticmethod
    def _record(rnd: Round) -> dict:
        results = rnd.results
        scored = [s for s in results if not s.error]
        has_signal = reports_correctness(scored)
        # With a verdict, an episode cut off before it (no `correct` component) counts as wrong.
        accuracy = sum(s.reward_components.get(CORRECT, 0.0) if has_signal else s.reward
                       for s in scored) / max(len(results), 1)
        versions = [v for s in results for v in (s.min_version, s.max_version)] or [rnd.version]
        record = {"kind": "eval", "version": rnd.version, "accuracy": accuracy,
                  "accuracy_source": "env_correct" if has_signal else "mean_reward",
                  "reward_mean": sum(s.reward for s in scored) / max(len(scored), 1),
                  "num_prompts": len(results), "num_errors": len(results) - len(scored), **episode_stats(scored),
                  # The policy versions that generated the answers: newer than `version` when the
                  # round ran beside training (learner.eval_overlap) and a weight update came first.
                  "generated_at_versions": [min(versions), max(versions)],
                  "eval_s": time.monotonic() - rnd.t0}
        log.info("held-out accuracy at version %d: %.3f (%d prompts)", rnd.version, accuracy, len(results))
        return record
