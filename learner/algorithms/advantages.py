"""Group-relative advantages for the GRPO family."""

from __future__ import annotations

import torch


def group_advantages(rewards_G: torch.Tensor, algorithm: str, eps: float = 1e-6) -> torch.Tensor:
    """Advantages for one group of `G` samples of the same prompt.

    grpo / dapo / gspo: (r - mean) / (std + eps)
    dr_grpo:            r - mean                       (no std scaling: Dr. GRPO)
    rloo:               r - mean of the other G-1      (leave-one-out baseline)
    """
    g = rewards_G.numel()
    mean = rewards_G.mean()
    if algorithm in ("grpo", "dapo", "gspo"):
        return (rewards_G - mean) / (rewards_G.std(unbiased=True) + eps) if g > 1 else rewards_G * 0
    if algorithm == "dr_grpo":
        return rewards_G - mean
    if algorithm == "rloo":
        return (rewards_G - mean) * g / (g - 1)
    raise ValueError(f"unknown algorithm {algorithm!r}; choose grpo, dr_grpo, dapo, gspo or rloo")
