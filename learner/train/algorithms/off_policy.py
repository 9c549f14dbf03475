"""Off-policy correction weights: how far the behaviour policy (vLLM, possibly a few versions old)
may differ from pi_old before a token or a whole sequence is truncated or dropped.

The ratio is pi_old / pi_behaviour on sampled tokens. `tis` truncates it per token (rlmesh's
original behaviour); `icepop` keeps a token's ratio inside [low, high] and zeroes it outside;
`seq_mask` and `seq_tis` do the same per sequence, from one ratio per sequence (the geometric
mean of its token ratios, or their product as TRL's `sequence_*` modes). The weight multiplies each
token's policy-gradient loss, without gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlmesh.services.config import AlgorithmSection, OffPolicySection, default


@dataclass(frozen=True)
class OffPolicyConfig:
    mode: str = default(OffPolicySection, "mode")
    tis_cap: float = default(AlgorithmSection, "tis_cap")
    low: float = default(OffPolicySection, "low")
    high: float = default(OffPolicySection, "high")
    seq_ratio: str = default(OffPolicySection, "seq_ratio")


def off_policy_weights(old_BT: torch.Tensor, behaviour_BT: torch.Tensor, mask_BT: torch.Tensor,
                       cfg: OffPolicyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_BT, dropped_BT): the detached weight of each token's loss, and which loss tokens the
    mode dropped (weight forced to 0; all False for the truncating modes)."""
    log_ratio_BT = ((old_BT - behaviour_BT) * mask_BT).detach()
    if cfg.mode in ("tis", "icepop"):
        ratio_BT = torch.exp(log_ratio_BT)
    elif cfg.mode in ("seq_mask", "seq_tis"):
        log_ratio_B1 = log_ratio_BT.sum(-1, keepdim=True)
        if cfg.seq_ratio == "geometric_mean":
            log_ratio_B1 = log_ratio_B1 / mask_BT.sum(-1, keepdim=True).clamp(min=1)
        ratio_BT = torch.exp(log_ratio_B1).expand_as(old_BT)
    else:
        raise ValueError(f"algorithm.off_policy.mode={cfg.mode!r}: choose tis, icepop, seq_mask or seq_tis")
    if cfg.mode in ("tis", "seq_tis"):
        return ratio_BT.clamp(max=cfg.tis_cap), torch.zeros_like(mask_BT, dtype=torch.bool)
    dropped_BT = ((ratio_BT < cfg.low) | (ratio_BT > cfg.high)) & (mask_BT > 0)
    return ratio_BT.masked_fill(dropped_BT, 0.0), dropped_BT
