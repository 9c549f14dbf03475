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
from typing import TYPE_CHECKING

from rlmesh.services.domain.pass_at_k import mean_pass_at_k
from rlmesh.learner.data.examples import Example
from rlmesh.learner.rl.issuer import PromptIssuer
from rlmesh.v1 import common_pb2
from rlmesh.services.queue import Entry, StreamQueue

if TYPE_CHECKING:
    from rlmesh.learner.trackers.metrics import MetricsWriter
    from rlmesh.learner.rl.reader import Arrivals

log = logging.getLogger(__name__)

CORRECT = "correct"

CUT_OFF = "max_turns"  # the finish reason of an episode stopped by the rollout tier's turn budget


def reports_correctness(scored: list[common_pb2.Sample]) -> bool:
    """True when the environment gave a `correct` verdict on every episode it finished."""
    verdicts = [CORRECT in s.reward_components for s in scored if s.finish_reason != CUT_OFF]
    return bool(verdicts) and all(verdicts)


def solved(sample: common_pb2.Sample) -> bool:
    """A sampled completion counts for pass@k when its `correct` component (else its reward) is
    at least 0.5 (else 1): an error or an episode cut off before a verdict never does."""
    if sample.error or sample.finish_reason == CUT_OFF:
        return False
    if CORRECT in sample.reward_components:
        return sample.reward_components[CORRECT] >= 0.5
    return sample.reward >= 1.0


def greedy_accuracy(results: list[common_pb2.Sample]) -> tuple[float, bool]:
    """(accuracy, whether it is the environment's `correct` verdict rather than the mean reward)."""
    scored = [s for s in results if not s.error]
    has_signal = reports_correctness(scored)
    # With a verdict, an episode cut off before it (no `correct` component) counts as wrong.
    accuracy = sum(s.reward_components.get(CORRECT, 0.0) if has_signal else s.reward
                   for s in scored) / max(len(results), 1)
    return accuracy, has_signal


def episode_stats(samples: list[common_pb2.Sample]) -> dict[str, float]:
    """Mean turns and mean reward components (e.g. `num_tool_calls`) over samples; empty when none."""
    if not samples:
        return {}
    out = {"turns_mean": sum(s.num_turns for s in samples) / len(samples)}
    for key in sorted({k for s in samples for k in s.reward_components}):
        out[f"{key}_mean"] = sum(s.reward_components.get(key, 0.0) for s in samples) / len(samples)
    return out


def answer_row(version: int, group: common_pb2.TrajectoryGroup, sample: common_pb2.Sample) -> dict:
    """One greedy held-out answer as eval_samples.jsonl holds it."""
    prompt = group.prompt.messages[-1].content if group.prompt.messages else ""
    return {"kind": "eval_sample", "version": version, "group_id": group.group_id, "env": group.prompt.env_name,
            "prompt": prompt, "completion": sample.text, "reward": sample.reward, "correct": solved(sample),
            "finish_reason": sample.finish_reason, "num_tokens": len(sample.completion.token_ids),
            "error": sample.error}


@dataclass
class Round:
    """One evaluation of the eval set, started at `version`."""

    version: int
    size: int  # eval groups issued
    t0: float = field(default_factory=time.monotonic)
    results: list[common_pb2.Sample] = field(default_factory=list)
    envs: list[str] = field(default_factory=list)  # the environment of each greedy result
    answers: dict[int, dict] = field(default_factory=dict)  # eval-set index -> the row eval_samples.jsonl gets
    sampled: list[tuple[str, int, int]] = field(default_factory=list)  # pass@k: (environment, n, correct)
    record: dict | None = None  # set when the last group is back


class Evaluator:
    """Rounds are started (`start`) and completed by the eval groups offered back to them (`offer`),
    so a round can finish while the learner trains (the controller offers what it reads); `run` is
    the blocking form, which reads with the `read` its caller gives (the controller's) and also
    finishes every round still open. A finished round's record goes to `metrics`."""

    def __init__(self, eval_set: list[Example], issuer: PromptIssuer, trajectories: StreamQueue,
                 metrics: MetricsWriter, *,
                 check: Callable[[common_pb2.TrajectoryGroup, int], str], timeout_s: float = 600.0,
                 pass_k: list[int] | None = None, num_samples: int | None = None,
                 samples: MetricsWriter | None = None, samples_per_round: int = 0) -> None:
        """`check(group, version)` says why an eval group of an open round is malformed (or ""),
        with the learner at `version`: such a group counts in its round as a failed answer.
        `samples`: where the first `samples_per_round` greedy answers of each round are written."""
        self.eval_set, self.issuer, self.trajectories = eval_set, issuer, trajectories
        self.metrics = metrics
        self.check = check
        self.first: dict | None = None  # the run's first record (kept in checkpoints across restarts)
        self.timeout_s = timeout_s
        # pass@k (learner.eval_pass_k): each prompt also gets `num_samples` sampled completions.
        self.pass_k = list(pass_k or [])
        self.num_samples = num_samples or max(self.pass_k, default=0)
        self.sampled_ids: set[str] = set()
        self.rounds: dict[str, Round] = {}  # eval group id -> its open round
        self.samples, self.samples_per_round = samples, samples_per_round if samples is not None else 0
        self.position: dict[str, int] = {}  # greedy eval group id -> its prompt's index in the eval set

    async def start(self, version: int) -> Round:
        rnd = Round(version, len(self.eval_set) * (2 if self.pass_k else 1))
        for i, ex in enumerate(self.eval_set):
            group = self.issuer.prompt_group(ex, "eval", 1, version, greedy=True)
            await self.issuer.publish(group)
            self.rounds[group.group_id] = rnd
            if i < self.samples_per_round:
                self.position[group.group_id] = i
            if self.pass_k:
                sampled = self.issuer.prompt_group(ex, "eval", self.num_samples, version, greedy=False)
                await self.issuer.publish(sampled)
                self.rounds[sampled.group_id] = rnd
                self.sampled_ids.add(sampled.group_id)
        if not self.eval_set:
            self._finish(rnd)
        return rnd

    async def offer(self, entry: Entry, group: common_pb2.TrajectoryGroup, version: int) -> dict | None:
        """An eval group read from the trajectory stream (the learner at `version`): acked, and
        counted in its round; returns the round's record if this completed it. Groups of no open
        round (e.g. issued before a restart, or forged) are only acked; a malformed one is a failed
        answer."""
        await self.trajectories.ack(entry.id)
        rnd = self.rounds.get(group.group_id)
        if rnd is None:
            return None
        reason = self.check(group, version)
        del self.rounds[group.group_id]
        self.issuer.ledger.returned(group.group_id)
        if group.group_id in self.sampled_ids:
            self.sampled_ids.discard(group.group_id)
            rnd.sampled.append((group.prompt.env_name, self.num_samples,
                                0 if reason else sum(solved(s) for s in group.samples[: self.num_samples])))
        else:
            rnd.results.append(common_pb2.Sample(error=f"dropped: {reason}") if reason else group.samples[0])
            rnd.envs.append(group.prompt.env_name)
            if (i := self.position.pop(group.group_id, None)) is not None:
                rnd.answers[i] = answer_row(rnd.version, group, rnd.results[-1])
        return self._finish(rnd) if len(rnd.results) + len(rnd.sampled) == rnd.size else None

    async def run(self, version: int, held_back: Arrivals, read: Callable[[int], Awaitable[Arrivals]]) -> dict:
        """Evaluate at `version` and wait for it (and any round still open), reading arrivals with
        `read(version)`; train groups that arrive meanwhile are appended to `held_back`."""
        rnd = await self.start(version)
        await self.finish(version, held_back, read)
        assert rnd.record is not None
        return rnd.record

    async def finish(self, version: int, held_back: Arrivals, read: Callable[[int], Awaitable[Arrivals]],
                     rnd: Round | None = None) -> None:
        """Wait until `rnd` (None: every open round) is complete: eval groups already read and held
        back are offered first, then arrivals are read with `read(version)`; train groups stay in, or
        are appended to, `held_back`."""
        def done() -> bool:
            return not self.rounds if rnd is None else rnd.record is not None

        async def route(arrivals: Arrivals) -> None:
            for entry, group in arrivals:
                if group.prompt.split == "train":
                    held_back.append((entry, group))
                else:
                    await self.offer(entry, group, version)

        arrivals, held_back[:] = list(held_back), []
        await route(arrivals)
        t0 = time.monotonic()
        while not done():
            await route(await read(version))
            if not done() and time.monotonic() - t0 > self.timeout_s:
                raise TimeoutError(f"{len(self.rounds)} eval groups not back after {self.timeout_s:.0f}s; "
                                   "is a rollout server running?")

    def _finish(self, rnd: Round) -> dict:
        rnd.record = self._record(rnd)
        if self.pass_k:
            rnd.record.update(self._pass_at_k(rnd))
        self.metrics.write(rnd.record)
        if self.samples is not None:
            for i in sorted(rnd.answers):
                self.samples.write(rnd.answers[i])
        if self.first is None:
            self.first = rnd.record
        return rnd.record

    def _pass_at_k(self, rnd: Round) -> dict:
        """Greedy accuracy and pass@k per environment, and pass@k over every prompt (`pass@4`)."""
        envs = sorted(set(rnd.envs) | {env for env, _, _ in rnd.sampled})
        counts = {env: [(n, c) for e, n, c in rnd.sampled if e == env] for env in envs}
        greedy = {env: [s for s, e in zip(rnd.results, rnd.envs) if e == env] for env in envs}
        out: dict = {"num_samples": self.num_samples,
                     "accuracy_by_env": {env: greedy_accuracy(greedy[env])[0] for env in envs},
                     "pass_at_k": {env: {str(k): mean_pass_at_k(counts[env], k) for k in self.pass_k}
                                   for env in envs if counts[env]}}
        everything = [(n, c) for _, n, c in rnd.sampled]
        for k in self.pass_k:
            out[f"pass@{k}"] = mean_pass_at_k(everything, k) if everything else 0.0
        log.info("held-out pass@k at version %d: %s", rnd.version,
                 ", ".join(f"pass@{k} {out[f'pass@{k}']:.3f}" for k in self.pass_k))
        return out

    @staticmethod
    def _record(rnd: Round) -> dict:
        results = rnd.results
        scored = [s for s in results if not s.error]
        accuracy, has_signal = greedy_accuracy(results)
        # Only answers count: a failed prompt (dropped, timed out) carries no versions of its own (its 0s
        # once made a round at version 10 read as generated from version 0).
        versions = [v for s in scored for v in (s.min_version, s.max_version)] or [rnd.version]
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
