import pytest
import torch

from rlmesh.learner.train.algorithms.advantages import group_advantages
from rlmesh.learner.train.algorithms.loss import LossConfig, policy_loss
from rlmesh.learner.train.batch import Sequence, pack, plan_step


def test_grpo_advantages_are_standardised():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), "grpo")
    assert torch.allclose(adv.mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(adv.std(), torch.tensor(1.0), atol=1e-4)


def test_rloo_is_leave_one_out():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    adv = group_advantages(r, "rloo")
    assert torch.allclose(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_dr_grpo_has_no_std_scaling():
    assert torch.allclose(group_advantages(torch.tensor([2.0, 0.0]), "dr_grpo"), torch.tensor([1.0, -1.0]))


def test_equal_rewards_give_zero_advantage():
    for name in ("grpo", "dr_grpo", "rloo", "dapo", "gspo"):
        assert torch.count_nonzero(group_advantages(torch.ones(4), name)) == 0


def test_unknown_algorithm_is_a_clear_error():
    with pytest.raises(ValueError, match="choose grpo"):
        group_advantages(torch.ones(2), "ppo")


def test_pack_aligns_loss_mask_with_targets():
    mb = pack([Sequence([5, 6, 7], [8, 9], [True, True], [-1.0, -2.0], 1.0)], pad_id=0)
    assert mb.input_ids_BT.tolist() == [[5, 6, 7, 8, 9]]
    # Targets are tokens 1..4 = [6, 7, 8, 9]; completion tokens 8, 9 are targets 2 and 3.
    assert mb.loss_mask_BT.tolist() == [[0, 0, 1, 1]]
    assert mb.behaviour_logprobs_BT.tolist() == [[0, 0, -1.0, -2.0]]


def _micro(seqs):
    micros = plan_step(seqs, 2, pad_id=0)
    for m in micros:
        m.old_logprobs_BT = torch.zeros_like(m.loss_mask_BT)
    return micros


def _seqs():
    return [Sequence([1, 2], [3, 4, 5], [True] * 3, [0.0] * 3, 1.0),
            Sequence([1, 2], [3], [True], [0.0], -1.0),
            Sequence([1], [3, 3], [True, True], [0.0, 0.0], 0.5)]


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo", "gspo", "rloo"])
def test_micro_batch_split_does_not_change_the_loss(algorithm):
    cfg = LossConfig(algorithm, 0.2, 0.28, 2.0, max_tokens=4)
    whole = plan_step(_seqs(), 8, pad_id=0)[0]
    whole.old_logprobs_BT = torch.zeros_like(whole.loss_mask_BT)
    total_whole = policy_loss(torch.zeros_like(whole.loss_mask_BT), whole, cfg)[0]
    total_split = sum(policy_loss(torch.zeros_like(m.loss_mask_BT), m, cfg)[0] for m in _micro(_seqs()))
    assert torch.allclose(total_whole, total_split, atol=1e-6)


def test_gradient_pushes_up_positive_advantage_tokens():
    cfg = LossConfig("grpo", 0.2, 0.2, 2.0, max_tokens=4)
    mb = pack([Sequence([1], [2, 3], [True, True], [-1.0, -1.0], advantage=1.0)], pad_id=0)
    mb.old_logprobs_BT = torch.full_like(mb.loss_mask_BT, -1.0)
    logprobs = torch.full_like(mb.loss_mask_BT, -1.0, requires_grad=True)
    loss, _ = policy_loss(logprobs, mb, cfg)
    loss.backward()
    assert (logprobs.grad[0, :2] < 0).all(), "descending the loss must raise the logprob of rewarded tokens"


def test_tis_weight_is_truncated_and_mismatch_is_reported():
    cfg = LossConfig("grpo", 0.2, 0.2, tis_cap=2.0, max_tokens=4)
    mb = pack([Sequence([1], [2], [True], [-5.0], advantage=1.0)], pad_id=0)
    mb.old_logprobs_BT = torch.zeros_like(mb.loss_mask_BT)  # pi_old / pi_b = e^5, far above the cap
    logprobs = torch.zeros_like(mb.loss_mask_BT, requires_grad=True)
    loss, metrics = policy_loss(logprobs, mb, cfg)
    loss.backward()
    assert torch.allclose(logprobs.grad[0, 0], torch.tensor(-2.0)), "weight must be capped at tis_cap"
    assert metrics["tis_truncated_frac"] == 1.0
    assert metrics["mismatch_abs_logprob"] == pytest.approx(5.0)


def test_equal_rewards_of_any_value_give_exactly_zero_advantage():
    # 0.97 * 8 has float rounding in (r - mean); equal rewards must still give exactly zero.
    for value in (0.97, 0.1, 1e-3, -2.3, 123.456):
        for name in ("grpo", "dr_grpo", "rloo", "dapo", "gspo"):
            adv = group_advantages(torch.full((8,), value), name)
            assert torch.count_nonzero(adv) == 0, (value, name, adv)
