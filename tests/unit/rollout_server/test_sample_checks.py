"""The rollout side fails a sample it must not hand to the learner: a reward that is not finite or
beyond reward.max_abs_reward, token data that do not line up, or an item the reward server's reply
left out (never left at reward 0)."""

import math

import pytest

from rlmesh.rollout_server.worker import RolloutWorker, sample_problem
from rlmesh.v1 import common_pb2, reward_pb2


def _sample(index: int = 0, reward: float = 1.0) -> common_pb2.Sample:
    return common_pb2.Sample(index=index, reward=reward, logprobs=[-0.1, -0.2],
                             completion=common_pb2.TokenSequence(token_ids=[3, 4], loss_mask=[True, True]))


def test_a_good_sample_passes():
    assert sample_problem(_sample(), max_abs_reward=10) == ""


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, 11.0, -3e38])
def test_rewards_must_be_finite_and_bounded(reward):
    assert "reward.max_abs_reward" in sample_problem(_sample(reward=reward), max_abs_reward=10)


def test_components_are_checked_too_and_token_data_must_line_up():
    s = _sample()
    s.reward_components["correct"] = math.nan
    assert "component 'correct'" in sample_problem(s, max_abs_reward=10)
    s = _sample()
    s.completion.loss_mask.append(True)
    assert "2 completion tokens, 3 loss-mask entries" in sample_problem(s, max_abs_reward=10)


class Rewards:
    def __init__(self, results):
        self.results = results

    async def score(self, request, what):
        return reward_pb2.ScoreResponse(results=self.results)


async def test_an_item_missing_from_the_score_reply_fails_instead_of_scoring_zero():
    worker = RolloutWorker(None, None, None, Rewards([reward_pb2.ScoreResult(id="1", reward=0.5)]), None,
                           consumer="c", max_concurrent_groups=1, max_abs_reward=10)
    samples = [_sample(0, 0.0), _sample(1, 0.0)]
    await worker._score(common_pb2.PromptGroup(group_id="g", env_name="arithmetic"), samples)
    assert "no result for item 0" in samples[0].error
    assert samples[1].reward == 0.5 and not samples[1].error
