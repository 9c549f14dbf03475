"""How a finished or failed episode becomes a Sample: the group's shared prompt, the loss mask,
turn offsets, and what `rollout.episode.on_error` does with a failure."""

import pytest

from rlmesh.rollout_server.episode import EpisodeTrace, common_prefix, trace_sample
from rlmesh.v1 import common_pb2


def _trace(error: str = "") -> EpisodeTrace:
    trace = EpisodeTrace(context=[1, 2, 3, 9, 9], num_prompt=5)
    trace.completion, trace.loss_mask, trace.logprobs = [7, 8, 5, 6], [True, True, False, False], [-0.1, -0.2, 0, 0]
    trace.context += trace.completion
    trace.turns = [common_pb2.Turn(start=0, num_sampled_tokens=2, num_env_tokens=2, min_version=2, max_version=3)]
    trace.reward, trace.components, trace.finish_reason = 1.0, {"correct": 1.0}, "done"
    if error:
        trace.error, trace.finish_reason = f"step_timeout: {error}", "step_timeout"
    return trace


def test_common_prefix():
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == [1, 2]
    assert common_prefix([[5], [6]]) == []


def test_the_unshared_prompt_tail_opens_the_completion_masked_out():
    sample = trace_sample(0, _trace(), 3, version=3)
    assert list(sample.completion.token_ids) == [9, 9, 7, 8, 5, 6]
    assert list(sample.completion.loss_mask) == [False, False, True, True, False, False]
    assert list(sample.logprobs) == pytest.approx([0.0, 0.0, -0.1, -0.2, 0.0, 0.0])
    assert sample.turns[0].start == 2 and (sample.min_version, sample.max_version) == (2, 3)
    assert sample.reward == 1.0 and sample.reward_components["correct"] == 1.0 and not sample.error


def test_a_failed_episode_is_dropped_by_default():
    sample = trace_sample(0, _trace("slow"), 5, version=3)
    assert sample.error == "step_timeout: slow" and sample.finish_reason == "step_timeout"


def test_a_failed_episode_is_trained_with_error_reward_under_penalize():
    sample = trace_sample(0, _trace("slow"), 5, version=3, error_reward=-1.0)
    assert not sample.error and sample.reward == -1.0
    assert sample.reward_components["episode_failed"] == 1.0 and sample.finish_reason == "step_timeout"


def test_an_episode_that_failed_before_sampling_is_never_trained():
    trace = EpisodeTrace(context=[], num_prompt=0, error="env_error: Reset failed", finish_reason="env_error")
    sample = trace_sample(0, trace, 0, version=3, error_reward=0.0)
    assert sample.error == "env_error: Reset failed" and not sample.completion.token_ids
