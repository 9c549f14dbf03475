"""The run's stall watch: what would otherwise make a run wait in silence. An error that repeats for
every prompt group (the rollout server rejects the prompt: a template, a tokenizer, a context
length; or every sample's reward errs) stops the run with the error and the tier that raised it;
groups whose rewards are all equal (no advantage: nothing to learn) are reported with the numbers
and, past a limit, stop the run too (or not: `learner.stall.on_zero_signal`).

What it says reaches the console through alert rows (`kind: alert`) in the run's metrics, which
`rlmesh up` prints; a fatal one is also raised (`RunStalled`), ending the learner with `STALLED_EXIT`,
which `rlmesh up` does not restart."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rlmesh.services.config import LearnerSection
    from rlmesh.v1 import common_pb2
    from rlmesh.services.queue import StreamQueue

log = logging.getLogger(__name__)

STALLED_EXIT = 3
"""The learner's exit code when the run cannot progress (not restarted by `rlmesh up`)."""


class RunStalled(RuntimeError):
    """The run cannot progress; the message says why and what to do."""


class Records(Protocol):
    def write(self, record: dict) -> None: ...


def failure_limit(learner: LearnerSection) -> int:
    return learner.stall.max_failed_groups or max(8, 2 * learner.groups_per_step)


def zero_signal_limit(learner: LearnerSection) -> int:
    return learner.stall.zero_signal_groups or max(32, 8 * learner.groups_per_step)


class StallWatch:
    """Counts groups that fail and groups with no signal, in a row; says so, and stops the run when
    they reach their limits. `failure_limit` 0 / `zero_signal_limit` 0 turn a check off."""

    def __init__(self, records: Records, *, failure_limit: int, zero_signal_limit: int = 0,
                 stop_on_zero_signal: bool = True, log_hint: str = "") -> None:
        self.records, self.log_hint = records, log_hint
        self.failure_limit, self.zero_signal_limit = failure_limit, zero_signal_limit
        self.stop_on_zero_signal = stop_on_zero_signal
        self.failed_in_a_row = 0
        self.failures: Counter[tuple[str, str, str]] = Counter()  # (tier, reason, service) of the failures in a row
        self.flat_in_a_row = 0
        self.flat_rewards: Counter[float] = Counter()  # the rewards of the flat groups in a row
        self._next_flat_warning = max(zero_signal_limit // 4, 1)
        self.t_first_failure = 0.0
        self.reward_range: tuple[float, float] | None = None  # the lowest and highest sample reward of the run

    def alert(self, message: str, *, fatal: bool = False) -> None:
        """A line for the console (an alert row); a fatal one is logged by whoever catches RunStalled."""
        if not fatal:
            log.warning("%s", message)
        self.records.write({"kind": "alert", "level": "fatal" if fatal else "warning", "message": message,
                            "time": time.time()})

    def succeeded(self) -> None:
        """A group came back with a reward signal (some samples scored differently)."""
        self.failed_in_a_row = self.flat_in_a_row = 0
        self.failures.clear()
        self.flat_rewards.clear()
        self._next_flat_warning = max(self.zero_signal_limit // 4, 1)

    def failed(self, tier: str, reason: str, service: str = "") -> None:
        """A group failed as a whole: `tier` says who raised `reason` (`service`: the name its log
        goes by, e.g. rollout-0). Raises RunStalled at the limit."""
        if not self.failed_in_a_row:
            self.t_first_failure = time.monotonic()
        self.failed_in_a_row += 1
        self.failures[(tier, reason[:500], service[:100])] += 1
        if self.failure_limit and self.failed_in_a_row >= self.failure_limit:
            (who, why, name), n = self.failures.most_common(1)[0]
            where = f" (its log: {self.log_hint.format(service=name)})" if self.log_hint and name else ""
            message = (f"the run cannot progress: {self.failed_in_a_row} prompt groups in a row failed in "
                       f"{time.monotonic() - self.t_first_failure:.0f}s and none succeeded; {n} of them in the "
                       f"{who}: {why}{where}")
            self.alert(message, fatal=True)
            raise RunStalled(message)

    def group_failed(self, group: common_pb2.TrajectoryGroup, reason: str) -> None:
        """`failed` for a trajectory group none of whose samples can be trained: the rollout server's
        fault when every error is its own (`invalid_sample`), else the reward server's."""
        by_rollout = all(s.error.startswith("invalid_sample") for s in group.samples if s.error)
        gen = group.generator_id[:100]
        self.failed(f"rollout server {gen}" if by_rollout else "reward server", reason, gen if by_rollout else "reward")

    def scored(self, rewards: list[float]) -> None:
        """A group's valid samples came back scored: with a signal, or all equal (no advantage)."""
        if rewards:
            low, high = self.reward_range or (min(rewards), max(rewards))
            self.reward_range = (min(low, *rewards), max(high, *rewards))
        if len(set(rewards)) > 1:
            self.succeeded()
            return
        self.failed_in_a_row = 0
        self.failures.clear()
        self.flat_in_a_row += 1
        self.flat_rewards[rewards[0] if rewards else 0.0] += 1
        if not self.zero_signal_limit:
            return
        rewards_seen = ", ".join(f"{n} at {r:g}" for r, n in self.flat_rewards.most_common(3))
        what = (f"no reward signal: {self.flat_in_a_row} groups in a row had every sample score the same "
                f"({rewards_seen})")
        (most, _), = self.flat_rewards.most_common(1)
        low, high = self.reward_range or (most, most)
        if most == high > low:  # most of them at the best reward the run has seen, where others scored lower
            what += (f": most at the run's best reward, {high:g}, on every sample, so the model solves these prompts "
                     "and no step can learn from them. Harder prompts (the data's settings) or a stricter reward "
                     "give it a signal again")
        else:
            what += (", so no step can learn from them. Check the model's footing with `rlmesh check -c CONFIG`: a "
                     "higher rollout.temperature, a larger algorithm.group_size, easier prompts, a prompt format "
                     "that fits the model (prompt.format, prompt.prefix) or a partial-credit reward can give it one")
        if self.flat_in_a_row >= self.zero_signal_limit and self.stop_on_zero_signal:
            message = what + f"; stopping (learner.stall.zero_signal_groups={self.zero_signal_limit}; " \
                             "learner.stall.on_zero_signal=warn goes on)"
            self.alert(message, fatal=True)
            raise RunStalled(message)
        if self.flat_in_a_row >= self._next_flat_warning:
            self._next_flat_warning *= 2
            self.alert(what)


class DeadLetters:
    """The prompt groups rollout servers rejected (`<prompt stream>:dead`), read as they come."""

    def __init__(self, prompts: StreamQueue) -> None:
        self.prompts = prompts
        self.last_id = "0-0"  # the caller keeps only its own groups' rejections

    async def poll(self) -> list[tuple[str, str, str]]:
        """(group id, rejecting rollout server, reason) of each rejection since the last poll."""
        out = []
        for entry_id, fields in await self.prompts.read_dead_letters(self.last_id):
            self.last_id = entry_id
            out.append((fields.get("key", ""), fields.get("by", "") or "rollout server", fields.get("reason", "")))
        return out
