"""Group-relative advantages for the GRPO family."""

from __future__ import annotations

import torch


def group_advantages(rewards_G: torch.Tensor, algorithm: str, eps: float = 1e-6) -> torch.Tensor:
    """Advantages for one group of `G` samples of the same prompt.

    grpo / dapo / gspo: (r - mean) / (std + eps)
    dr_grpo:            r - mean                       (no std scaling: Dr. GRPO)
    rloo:               r - mean of the other G-1      (leave-one-out baseline)
    """
    if algorithm not in ("grpo", "dapo", "gspo", "dr_grpo", "rloo"):
        raise ValueError(f"unknown algorithm {algorithm!r}; choose grpo, dr_grpo, dapo, gspo or rloo")
    g = rewards_G.numel()
    if g < 2 or bool((rewards_G == rewards_G[0]).all()):
        # No signal in the group: exactly zero, not float noise from (r - mean) / (std + eps).
        return torch.zeros_like(rewards_G, dtype=torch.float32)
    mean = rewards_G.mean()
    if algorithm in ("grpo", "dapo", "gspo"):
        return (rewards_G - mean) / (rewards_G.std(unbiased=True) + eps)
    if algorithm == "dr_grpo":
        return rewards_G - mean
    return (rewards_G - mean) * g / (g - 1)  # rloo
