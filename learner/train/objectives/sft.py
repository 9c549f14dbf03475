"""Supervised fine-tuning as an objective: masked NLL on assistant tokens."""

from __future__ import annotations

import torch

from rlmesh.learner.train.algorithms.loss import sft_loss
from rlmesh.learner.train.batch import MicroBatch


class SFTObjective:
    name = "sft"
    needs_old_logprobs = False

    def loss(self, logprobs_BT: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return sft_loss(logprobs_BT, micro)
