"""The learning-rate schedules: RL's (`learner.lr_schedule`), the rate of the optimizer step that
takes the policy from one version to the next, and the SFT warm start's (`sft.lr_schedule`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlmesh.services.config import LearnerSection, SFTSection


def learning_rate(cfg: LearnerSection, version: int) -> float:
    """The rate of the step from `version` to `version + 1`: `cfg.lr` throughout (constant), or
    decayed linearly from `cfg.lr` at version 0 to `cfg.lr * cfg.lr_final_ratio` at version
    `cfg.num_steps - 1` (linear); times (version + 1) / cfg.warmup_steps while that is below 1."""
    warmup = min((version + 1) / cfg.warmup_steps, 1.0) if cfg.warmup_steps else 1.0
    if cfg.lr_schedule == "constant":
        return cfg.lr * warmup
    progress = version / max(cfg.num_steps - 1, 1)
    return cfg.lr * (1 - (1 - cfg.lr_final_ratio) * min(progress, 1.0)) * warmup


def sft_learning_rate(cfg: SFTSection, step: int) -> float:
    """The rate of SFT step `step` (1-based): `cfg.lr` throughout (constant), or a linear warm-up
    over `cfg.warmup_steps` followed by a cosine decay from `cfg.lr` to `cfg.lr * cfg.lr_final_ratio`
    at step `cfg.num_steps` (cosine)."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    progress = min((step - cfg.warmup_steps) / max(cfg.num_steps - cfg.warmup_steps, 1), 1.0)
    floor = cfg.lr * cfg.lr_final_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
