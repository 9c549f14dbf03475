"""What a train record says about the trajectory groups a step trained (the controller adds the
learner's own counters, timings and metrics): rewards, lengths, staleness, who generated them."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from rlmesh.learner.rl.evaluator import episode_stats

if TYPE_CHECKING:
    from rlmesh.v1 import common_pb2


def oldest_versions(groups: list[common_pb2.TrajectoryGroup]) -> dict[str, int]:
    """The oldest policy version any sample of each rollout server's groups was generated with."""
    oldest: dict[str, int] = {}
    for g in groups:
        version = min((s.min_version for s in g.samples), default=0)
        oldest[g.generator_id] = min(oldest.get(g.generator_id, version), version)
    return oldest


def groups_record(groups: list[common_pb2.TrajectoryGroup], ages: list[int], flat_rewards: list[float]) -> dict:
    """The record's fields drawn from `groups` and their staleness `ages`; `flat_rewards` are those of
    the all-equal groups dropped since the last step (dynamic sampling)."""
    samples = [s for g in groups for s in g.samples if not s.error]
    num_tokens = sum(len(s.completion.token_ids) for s in samples)
    # Under dynamic sampling the trained groups are only those with a signal: the reward of
    # everything generated since the last step counts the all-equal groups dropped too.
    generated = [s.reward for s in samples] + flat_rewards
    return {
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "reward_mean_generated": sum(generated) / len(generated),
        "num_groups": len(groups), "num_samples": len(samples), "num_tokens": num_tokens,
        "completion_tokens": [len(s.completion.token_ids) for s in samples],  # each sample's length
        "staleness_mean": sum(ages) / len(ages), "staleness_max": max(ages),
        "staleness_counts": {str(age): n for age, n in sorted(Counter(ages).items())},
        "groups_by_generator": dict(Counter(g.generator_id for g in groups)),
        # The oldest weights each rollout server generated this step's groups with (a server that
        # joined serves only once it holds the learner's weights: never older than its first update).
        "oldest_version_by_generator": oldest_versions(groups),
        "num_failed_samples": sum(1 for g in groups for s in g.samples if s.error),
        # Groups whose rewards differ (only those give GRPO an advantage), and completions cut at max_tokens.
        "num_groups_with_signal": sum(1 for g in groups if len({s.reward for s in g.samples if not s.error}) > 1),
        "share_cut": sum(1 for s in samples if s.finish_reason == "length") / len(samples),
        **episode_stats(samples),
    }
