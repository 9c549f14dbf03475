"""Clipped policy-gradient loss with off-policy correction against the behaviour (vLLM) logprobs.

Three policies meet here: pi_behaviour (what vLLM sampled with, possibly several versions old),
pi_old (the learner's weights at the start of this step: recomputed by a no-grad forward, or the
training forward's own logprobs, detached) and pi_theta (being trained).
The PPO ratio pi_theta / pi_old is clipped as usual; the off-policy weight from pi_old / pi_behaviour
(`off_policy.py`: truncated per token by default, TIS) corrects for staleness and train/inference
mismatch. With `kl_coef` > 0 and `kl_where` = loss, coef * KL(pi_theta || pi_ref) per token (a
frozen reference policy's logprobs, `kl.py`) joins each token's loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlmesh.learner.train.algorithms.kl import kl_estimate
from rlmesh.learner.train.algorithms.off_policy import OffPolicyConfig, off_policy_weights
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
    off_policy: OffPolicyConfig | None = None
    """The off-policy correction; None: token-level TIS capped at `tis_cap`."""
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: float | None = None
    kl_in_loss: bool = False
    """Add kl_coef * estimator(pi_theta, pi_ref) to each token's loss (needs micro.ref_logprobs_BT)."""


def step_normaliser(cfg: LossConfig, num_seqs: float, num_loss_tokens: float) -> float:
    """What a step's summed loss is divided by: its loss tokens (DAPO), max_tokens per sequence
    (Dr. GRPO), or its sequences (each one's loss already a mean over its tokens)."""
    if cfg.algorithm == "dapo":
        return num_loss_tokens
    if cfg.algorithm == "dr_grpo":
        return cfg.max_tokens * num_seqs
    return num_seqs


def policy_loss(logprobs_BT: torch.Tensor, micro: MicroBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    mask_BT = micro.loss_mask_BT
    old_BT = micro.old_logprobs_BT
    if old_BT is None:
        assert cfg.old_from_forward, "old logprobs must be recomputed before the step"
        old_BT = logprobs_BT.detach()
    # [B, 1] (one advantage per sequence) or [B, T-1] (per token: per-turn credit); both broadcast.
    adv_B1 = micro.advantages_BT if micro.advantages_BT is not None else micro.advantages_B[:, None]

    log_ratio_BT = (logprobs_BT - old_BT) * mask_BT
    off_cfg = cfg.off_policy or OffPolicyConfig(tis_cap=cfg.tis_cap)
    tis_BT, dropped_BT = off_policy_weights(old_BT, micro.behaviour_logprobs_BT, mask_BT, off_cfg)

    if cfg.algorithm == "gspo":
        # Sequence-level ratio: geometric mean of token ratios, clipped per sequence.
        seq_len_B = mask_BT.sum(-1).clamp(min=1)
        ratio_B1 = torch.exp(log_ratio_BT.sum(-1) / seq_len_B)[:, None]
        ratio_BT = ratio_B1.expand_as(logprobs_BT)
    else:
        ratio_BT = torch.exp(log_ratio_BT)
    clipped_BT = ratio_BT.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    per_token_BT = -torch.minimum(ratio_BT * adv_B1, clipped_BT * adv_B1) * tis_BT * mask_BT
    if cfg.kl_in_loss:
        assert micro.ref_logprobs_BT is not None, "reference logprobs must be computed before the step"
        kl_BT = kl_estimate(logprobs_BT, micro.ref_logprobs_BT, cfg.kl_estimator, cfg.kl_clamp)
        per_token_BT = per_token_BT + cfg.kl_coef * kl_BT * mask_BT

    # Normalisers span the whole step so micro-batch splits do not change the gradient.
    if cfg.algorithm in ("dapo", "dr_grpo"):
        summed = per_token_BT.sum()
    else:  # grpo, gspo, rloo: mean over each sequence's tokens, then over sequences
        summed = (per_token_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)).sum()
    loss = summed / step_normaliser(cfg, micro.num_seqs_in_step, micro.num_loss_tokens_in_step)

    with torch.no_grad():
        n = mask_BT.sum().clamp(min=1)
        diff_BT = (micro.behaviour_logprobs_BT - old_BT) * mask_BT
        metrics = {
            # k3 estimator of KL(behaviour || learner) on sampled tokens: train/inference mismatch.
            "mismatch_kl": float(((torch.exp(-diff_BT) - 1 + diff_BT) * mask_BT).sum() / n),
            "mismatch_abs_logprob": float(diff_BT.abs().sum() / n),
            "tis_truncated_frac": float(((torch.exp(-diff_BT) > cfg.tis_cap).float() * mask_BT).sum() / n),
            # Loss tokens the off-policy mode dropped (icepop, seq_mask; 0 for the truncating modes).
            "off_policy_masked_frac": float(dropped_BT.float().sum() / n),
            "clip_frac": float((((ratio_BT - clipped_BT).abs() > 1e-6).float() * mask_BT).sum() / n),
        }
        if cfg.kl_in_loss:
            metrics["kl_ref"] = float((kl_BT * mask_BT).sum() / n)
    return loss, metrics
