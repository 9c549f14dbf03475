"""Per-turn credit against advantages computed by hand on small groups, and its path into the loss:
each turn's sampled tokens carry its advantage, environment tokens stay out of the loss mask."""

from __future__ import annotations

import math

import pytest
import torch

from rlmesh.learner.train.algorithms.loss import LossConfig, policy_loss
from rlmesh.learner.train.algorithms.turn_credit import returns, turn_advantages, turn_spans
from rlmesh.learner.train.batch import plan_step
from rlmesh.learner.train.objectives.grpo import GRPOObjective
from rlmesh.services.config import load_config
from rlmesh.v1 import common_pb2

ENV = 90  # an environment token id


def _sample(turns: list[tuple[list[int], float]], env_tokens: int = 2, reward: float | None = None) -> common_pb2.Sample:
    """A multi-turn sample: each turn's sampled ids and reward, `env_tokens` environment ids between turns."""
    ids, mask, records = [], [], []
    for k, (sampled, turn_reward) in enumerate(turns):
        records.append(common_pb2.Turn(start=len(ids), num_sampled_tokens=len(sampled), reward=turn_reward,
                                       num_env_tokens=env_tokens if k < len(turns) - 1 else 0))
        ids += sampled
        mask += [True] * len(sampled)
        if k < len(turns) - 1:
            ids += [ENV] * env_tokens
            mask += [False] * env_tokens
    total = sum(r for _, r in turns) if reward is None else reward
    return common_pb2.Sample(completion=common_pb2.TokenSequence(token_ids=ids, loss_mask=mask),
                             logprobs=[-1.0] * len(ids), reward=total, turns=records, num_turns=len(turns))


def _group(*samples: common_pb2.Sample) -> common_pb2.TrajectoryGroup:
    return common_pb2.TrajectoryGroup(group_id="g", prompt_token_ids=[1, 2], samples=samples)


def _std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def test_returns_discount_what_follows():
    assert returns([0.0, 0.5, 1.0], 1.0) == [1.5, 1.5, 1.0]
    assert returns([0.0, 0.5, 1.0], 0.5) == [0.5, 1.0, 1.0]


def test_turn_rewards_sum_to_the_samples_reward_the_rest_on_the_last_turn():
    sample = _sample([([3], 0.25), ([4], 0.0)], reward=1.0)  # e.g. an episode-level component at the end
    assert [s.reward for s in turn_spans(sample)] == [0.25, 0.75]
    single = common_pb2.Sample(completion=common_pb2.TokenSequence(token_ids=[5, 6, 7]), reward=0.5)
    assert turn_spans(single)[0].length == 3 and turn_spans(single)[0].reward == 0.5


def test_turn_credit_normalises_every_turns_return_within_the_group():
    # A: a good tool call (0.5) then a wrong answer (0); B: a bad call (0) then a right answer (1).
    a = _sample([([3, 4], 0.5), ([5], 0.0)])
    b = _sample([([6], 0.0), ([7, 8], 1.0)])
    adv = turn_advantages(_group(a, b), [a, b], "grpo", "turn", discount=1.0)
    # Returns with gamma 1: A = [0.5, 0.0], B = [1.0, 1.0]; mean 0.625, sample std over the 4.
    rets = [0.5, 0.0, 1.0, 1.0]
    mean, std = sum(rets) / 4, _std(rets)
    want = [(g - mean) / (std + 1e-6) for g in rets]
    assert adv[0] == pytest.approx([want[0], want[0], 0.0, 0.0, want[1]], abs=1e-6)  # env tokens 0
    assert adv[1] == pytest.approx([want[2], 0.0, 0.0, want[3], want[3]], abs=1e-6)
    # A's tool call is credited above its wrong answer; episode-level credit would give them one value.
    assert adv[0][0] > adv[0][4]


def test_dr_grpo_and_rloo_keep_their_own_baselines_over_turns():
    a, b = _sample([([3], 1.0)]), _sample([([4], 0.0), ([5], 0.0)])
    dr = turn_advantages(_group(a, b), [a, b], "dr_grpo", "turn")
    mean = 1.0 / 3
    assert dr[0] == pytest.approx([1 - mean]) and dr[1] == pytest.approx([-mean, 0, 0, -mean])
    rloo = turn_advantages(_group(a, b), [a, b], "rloo", "turn")
    assert rloo[0] == pytest.approx([(1 - mean) * 3 / 2]) and rloo[1][0] == pytest.approx(-mean * 3 / 2)


def test_equal_returns_everywhere_give_no_signal():
    a, b = _sample([([3], 0.0), ([4], 1.0)]), _sample([([5], 1.0)])
    assert turn_advantages(_group(a, b), [a, b], "grpo", "turn") == [[0.0, 0.0, 0.0, 0.0], [0.0]]


def test_turn_state_adds_the_same_state_comparison_to_the_episode_advantage():
    # Three episodes: A and B open with the same first action [3] and so meet the same second state.
    a = _sample([([3], 0.0), ([4], 1.0)])
    b = _sample([([3], 0.0), ([5], 0.0)])
    c = _sample([([6], 0.0), ([7], 0.0)])
    adv = turn_advantages(_group(a, b, c), [a, b, c], "grpo", "turn_state", state_weight=0.5)
    episode = [(r - 1 / 3) / (_std([1.0, 0.0, 0.0]) + 1e-6) for r in (1.0, 0.0, 0.0)]
    # First turns: one state (the prompt) for all three; returns 1, 0, 0.
    first = episode  # the same numbers: returns equal the episode rewards here
    # Second turns: A and B share a state (prompt + [3] + env), returns 1 and 0; C's is its own.
    second_ab = [1 / math.sqrt(0.5), -1 / math.sqrt(0.5)]  # (1 - .5) / std([1, 0]) = 0.7071..., mirrored
    assert adv[0][0] == pytest.approx(episode[0] + 0.5 * first[0], abs=1e-5)
    assert adv[0][3] == pytest.approx(episode[0] + 0.5 * second_ab[0] / 2, rel=1e-4)
    assert adv[1][3] == pytest.approx(episode[1] + 0.5 * second_ab[1] / 2, rel=1e-4)
    assert adv[2][3] == pytest.approx(episode[2], abs=1e-6)  # no other turn from C's state
    assert adv[1][1] == adv[1][2] == 0.0  # environment tokens


def test_per_turn_advantages_reach_the_loss_token_by_token():
    a = _sample([([3, 4], 0.5), ([5], 0.0)])
    b = _sample([([6], 0.0), ([7, 8], 1.0)])
    config = load_config(None, ["algorithm.credit.assign=turn", "algorithm.name=dapo"])
    objective = GRPOObjective.from_config(config)
    seqs = objective.sequences([_group(a, b)])
    assert seqs[0].token_advantages is not None
    (micro,) = plan_step(seqs, 2, pad_id=0)
    assert micro.advantages_BT is not None
    n_p = 2
    for row, seq in enumerate(seqs):
        got = micro.advantages_BT[row, n_p - 1: n_p - 1 + len(seq.completion_ids)].tolist()
        assert got == pytest.approx(seq.token_advantages)
        assert micro.loss_mask_BT[row, n_p - 1: n_p - 1 + len(seq.completion_ids)].tolist() == \
            [float(m) for m in seq.loss_mask]
    # The loss's gradient on each sampled token is -advantage / tokens (DAPO, ratio 1): per token.
    micro.old_logprobs_BT = torch.zeros_like(micro.loss_mask_BT)
    micro.behaviour_logprobs_BT = torch.zeros_like(micro.loss_mask_BT)  # on-policy: no TIS weight
    logprobs = torch.zeros_like(micro.loss_mask_BT, requires_grad=True)
    loss, _ = policy_loss(logprobs, micro, LossConfig("dapo", 0.2, 0.2, 2.0, 16))
    loss.backward()
    expected = -(micro.advantages_BT * micro.loss_mask_BT) / micro.num_loss_tokens_in_step
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    assert logprobs.grad[0, n_p - 1] != logprobs.grad[0, n_p + 3]  # two turns of one episode differ


def test_episode_credit_is_unchanged_and_reward_kl_is_refused_with_turn_credit():
    a, b = _sample([([3], 1.0)]), _sample([([4], 0.0)])
    seqs = GRPOObjective.from_config(load_config(None, [])).sequences([_group(a, b)])
    assert all(s.token_advantages is None for s in seqs)
    (micro,) = plan_step(seqs, 2, pad_id=0)
    assert micro.advantages_BT is None
    with pytest.raises(Exception, match="algorithm.kl.where=loss"):
        load_config(None, ["algorithm.credit.assign=turn", "algorithm.kl.coef=0.1", "algorithm.kl.where=reward"])
