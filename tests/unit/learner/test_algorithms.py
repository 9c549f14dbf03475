import math

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


def _to_BT(micro, seqs, per_token):
    """Per-completion-token values of each of `micro`'s sequences, at their target positions;
    elsewhere a value the loss must ignore."""
    out_BT = torch.full_like(micro.loss_mask_BT, 7.0)
    for row, i in enumerate(micro.seq_index_B):
        start = len(seqs[i].prompt_ids) - 1  # completion token j is target start + j
        out_BT[row, start : start + len(per_token[i])] = torch.tensor(per_token[i])
    return out_BT


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo", "gspo", "rloo"])
def test_micro_batch_split_does_not_change_the_loss(algorithm):
    cfg = LossConfig(algorithm, 0.2, 0.28, 2.0, max_tokens=4)
    seqs = _seqs()
    # Ratios away from 1, different within each sequence, so clipping and the sequence ratio matter.
    learner = [[0.3, -0.1, 0.05], [-0.25], [0.1, -0.4]]
    whole = plan_step(seqs, 8, pad_id=0)[0]
    whole.old_logprobs_BT = torch.zeros_like(whole.loss_mask_BT)
    total_whole = policy_loss(_to_BT(whole, seqs, learner), whole, cfg)[0]
    total_split = sum(policy_loss(_to_BT(m, seqs, learner), m, cfg)[0] for m in _micro(seqs))
    assert torch.allclose(total_whole, total_split, atol=1e-6)


# Three sequences whose learner / old / behaviour logprobs differ by different amounts token by
# token: the GSPO sequence ratio (a geometric mean) is then not any of its tokens' ratios, some
# token ratios clip where their sequence's does not (and the other way round), and one masked
# token (a tool result) carries a ratio far outside the clip range that must count for nothing.
_CLIP_LOW, _CLIP_HIGH, _TIS_CAP, _MAX_TOKENS = 0.2, 0.28, 2.0, 8
_PROMPTS = [[1, 2], [1], [1, 2]]
_MASKS = [[True, True, True], [True, True, False, True], [True, True]]
_ADVANTAGES = [1.0, -0.5, 0.8]
_OLD = [[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.0, -0.7], [-1.5, -0.2]]
_LOG_RATIOS = [[0.35, -0.15, 0.05], [-0.4, -0.1, 5.0, -0.25], [-0.3, 0.1]]  # learner - old
_STALENESS = {  # behaviour - old: none, or enough that one token's TIS weight is truncated
    "on_policy": [[0.0] * 3, [0.0] * 4, [0.0] * 2],
    "stale": [[0.0, 0.2, -1.0], [0.1, -0.3, 0.0, 0.05], [-0.2, 0.0]],
}


def _reference_loss(algorithm: str, learner: list[torch.Tensor], behaviour: list[list[float]]) -> torch.Tensor:
    """Each algorithm's loss as its paper writes it, one sequence at a time in plain loops (no
    packing, no masks): minus the clipped surrogate, each token weighted by its truncated
    importance weight min(pi_old / pi_behaviour, cap) (token-level TIS, rlmesh's default)."""
    per_seq_terms = []
    for lp, old, beh, mask, adv in zip(learner, _OLD, behaviour, _MASKS, _ADVANTAGES):
        kept = [t for t, m in enumerate(mask) if m]
        weights = [min(math.exp(old[t] - beh[t]), _TIS_CAP) for t in kept]
        if algorithm == "gspo":
            # GSPO (Zheng et al. 2025, eq. 7): s_i = (pi_theta(y_i|x) / pi_old(y_i|x)) ** (1 / |y_i|).
            s = torch.exp(sum(lp[t] - old[t] for t in kept) / len(kept))
            ratios = [s for _ in kept]
        else:
            # GRPO (Shao et al. 2024), DAPO, Dr. GRPO, RLOO: one ratio per token.
            ratios = [torch.exp(lp[t] - old[t]) for t in kept]
        per_seq_terms.append([
            w * torch.minimum(r * adv, r.clamp(1 - _CLIP_LOW, 1 + _CLIP_HIGH) * adv)
            for r, w in zip(ratios, weights)])
    num_seqs = len(per_seq_terms)
    if algorithm == "dapo":  # token-level: one mean over every token of the batch
        objective = sum(sum(terms) for terms in per_seq_terms) / sum(len(terms) for terms in per_seq_terms)
    elif algorithm == "dr_grpo":  # a constant normaliser: no 1/|o_i| length bias
        objective = sum(sum(terms) for terms in per_seq_terms) / (num_seqs * _MAX_TOKENS)
    else:  # grpo, gspo, rloo: mean over each sequence's tokens, then over sequences
        objective = sum(sum(terms) / len(terms) for terms in per_seq_terms) / num_seqs
    return -objective


def _reference(algorithm: str, staleness: str) -> tuple[float, list[list[float]]]:
    """The reference loss and its gradient with respect to every completion token's logprob."""
    learner = [torch.tensor([o + d for o, d in zip(old, dr)], dtype=torch.float64, requires_grad=True)
               for old, dr in zip(_OLD, _LOG_RATIOS)]
    behaviour = [[o + d for o, d in zip(old, db)] for old, db in zip(_OLD, _STALENESS[staleness])]
    loss = _reference_loss(algorithm, learner, behaviour)
    loss.backward()
    return float(loss.detach()), [lp.grad.tolist() for lp in learner]


def _rlmesh(algorithm: str, staleness: str) -> tuple[float, list[list[float]]]:
    seqs = [Sequence(p, [3] * len(m), m, [o + d for o, d in zip(old, db)], adv)
            for p, m, old, db, adv in zip(_PROMPTS, _MASKS, _OLD, _STALENESS[staleness], _ADVANTAGES)]
    micro = plan_step(seqs, len(seqs), pad_id=0)[0]
    micro.old_logprobs_BT = _to_BT(micro, seqs, _OLD)
    learner = [[o + d for o, d in zip(old, dr)] for old, dr in zip(_OLD, _LOG_RATIOS)]
    logprobs_BT = _to_BT(micro, seqs, learner).requires_grad_()
    cfg = LossConfig(algorithm, _CLIP_LOW, _CLIP_HIGH, _TIS_CAP, max_tokens=_MAX_TOKENS)
    loss, _ = policy_loss(logprobs_BT, micro, cfg)
    loss.backward()
    grads = [logprobs_BT.grad[i, len(p) - 1 : len(p) - 1 + len(m)].tolist() for i, (p, m) in enumerate(zip(_PROMPTS, _MASKS))]
    return float(loss.detach()), grads


@pytest.mark.parametrize("staleness", sorted(_STALENESS))
@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo", "gspo", "rloo"])
def test_loss_and_gradient_match_the_papers_away_from_ratio_one(algorithm, staleness):
    want_loss, want_grads = _reference(algorithm, staleness)
    got_loss, got_grads = _rlmesh(algorithm, staleness)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    for got, want in zip(got_grads, want_grads):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), (got_grads, want_grads)


def test_the_cases_above_tell_gspo_from_grpo():
    # Guards the data above: were GSPO's and GRPO's references equal there (as at ratio 1), a gspo
    # computing grpo's loss would pass the test above.
    for staleness in _STALENESS:
        gspo_loss, gspo_grads = _reference("gspo", staleness)
        grpo_loss, grpo_grads = _reference("grpo", staleness)
        assert abs(gspo_loss - grpo_loss) > 1e-3
        assert max(abs(a - b) for ga, gb in zip(gspo_grads, grpo_grads) for a, b in zip(ga, gb)) > 1e-2
