"""Clipped policy-gradient loss with off-policy correction against the behaviour (vLLM) logprobs.

Three policies meet here: pi_behaviour (what vLLM sampled with, possibly several versions old),
pi_old (the learner's weights at the start of this step: recomputed by a no-grad forward, or the
training forward's own logprobs, detached) and pi_theta (being trained).
The PPO ratio pi_theta / pi_old is clipped as usual; the truncated importance weight
min(pi_old / pi_behaviour, tis_cap) corrects for staleness and train/inference mismatch (TIS)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlmesh.learner.train.batch import MicroBatch


@dataclass(frozen=True)
class LossConfig:
    algorithm: str
    clip_low: float
    clip_high: float
    tis_cap: float
    max_tokens: int
    old_from_forward: bool = False
    """pi_old = this forward's logprobs, detached, where none were recomputed (exact while a batch
    gets one optimizer step: every micro-batch's forward runs on the weights the step started from)."""


def policy_loss(logprobs_BT: torch.Tensor, micro: MicroBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    mask_BT = micro.loss_mask_BT
    old_BT = micro.old_logprobs_BT
    if old_BT is None:
        assert cfg.old_from_forward, "old logprobs must be recomputed before the step"
        old_BT = logprobs_BT.detach()
    adv_B1 = micro.advantages_B[:, None]

    log_ratio_BT = (logprobs_BT - old_BT) * mask_BT
    tis_BT = torch.exp((old_BT - micro.behaviour_logprobs_BT) * mask_BT).clamp(max=cfg.tis_cap).detach()

    if cfg.algorithm == "gspo":
        # Sequence-level ratio: geometric mean of token ratios, clipped per sequence.
        seq_len_B = mask_BT.sum(-1).clamp(min=1)
        ratio_B1 = torch.exp(log_ratio_BT.sum(-1) / seq_len_B)[:, None]
        ratio_BT = ratio_B1.expand_as(logprobs_BT)
    else:
        ratio_BT = torch.exp(log_ratio_BT)
    clipped_BT = ratio_BT.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token_BT = -torch.minimum(ratio_BT * adv_B1, clipped_BT * adv_B1) * tis_BT * mask_BT

    # Normalisers span the whole step so micro-batch splits do not change the gradient.
    if cfg.algorithm in ("dapo",):
        loss = per_token_BT.sum() / micro.num_loss_tokens_in_step
    elif cfg.algorithm == "dr_grpo":
        loss = per_token_BT.sum() / (cfg.max_tokens * micro.num_seqs_in_step)
    else:  # grpo, gspo, rloo: mean over each sequence's tokens, then over sequences
        loss = (per_token_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)).sum() / micro.num_seqs_in_step

    with torch.no_grad():
        n = mask_BT.sum().clamp(min=1)
        diff_BT = (micro.behaviour_logprobs_BT - old_BT) * mask_BT
        metrics = {
            # k3 estimator of KL(behaviour || learner) on sampled tokens: train/inference mismatch.
            "mismatch_kl": float(((torch.exp(-diff_BT) - 1 + diff_BT) * mask_BT).sum() / n),
            "mismatch_abs_logprob": float(diff_BT.abs().sum() / n),
            "tis_truncated_frac": float(((torch.exp(-diff_BT) > cfg.tis_cap).float() * mask_BT).sum() / n),
            "clip_frac": float((((ratio_BT - clipped_BT).abs() > 1e-6).float() * mask_BT).sum() / n),
        }
    return loss, metrics
