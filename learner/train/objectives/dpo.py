"""Direct preference optimisation as an objective: (chosen, rejected) pairs against a frozen
reference policy whose logprobs were computed before training (`rlmesh.learner.recipes.dpo`)."""

from __future__ import annotations

import torch

from rlmesh.learner.train.algorithms.loss import dpo_loss
from rlmesh.learner.train.batch import MicroBatch


class DPOObjective:
    name = "dpo"
    needs_old_logprobs = False

    def __init__(self, beta: float, sft_weight: float = 0.0) -> None:
        self.beta, self.sft_weight = beta, sft_weight

    def loss(self, logprobs_BT: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return dpo_loss(logprobs_BT, micro, self.beta, self.sft_weight)
