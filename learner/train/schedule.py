"""The learning-rate schedule (`learner.lr_schedule`): the rate of the optimizer step that takes
the policy from one version to the next."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlmesh.services.config import LearnerSection


def learning_rate(cfg: LearnerSection, version: int) -> float:
    """`cfg.lr` throughout (constant), or decayed linearly from `cfg.lr` at version 0 to
    `cfg.lr * cfg.lr_final_ratio` at version `cfg.num_steps - 1` (linear)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = version / max(cfg.num_steps - 1, 1)
    return cfg.lr * (1 - (1 - cfg.lr_final_ratio) * min(progress, 1.0))
