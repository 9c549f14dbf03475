"""The GRPO family as an objective: group-relative advantages from trajectory groups, and the
clipped policy-gradient loss with off-policy correction (`rlmesh.learner.train.algorithms`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlmesh.learner.train.algorithms.advantages import group_advantages
from rlmesh.learner.train.algorithms.loss import LossConfig, policy_loss
from rlmesh.learner.train.batch import MicroBatch, Sequence

if TYPE_CHECKING:
    from rlmesh.v1 import common_pb2
    from rlmesh.services.config import AlgorithmSection, RunConfig


class GRPOObjective:
    def __init__(self, cfg: AlgorithmSection, *, max_tokens: int, temperature: float) -> None:
        self.name = cfg.name
        # Logprobs of what vLLM sampled, at the temperature it sampled with.
        self.temperature = temperature
        # Without the recompute, the loss takes pi_old from the training forward (detached).
        self.needs_old_logprobs = cfg.recompute_old_logprobs
        self.cfg = LossConfig(cfg.name, cfg.clip_low, cfg.clip_high, cfg.tis_cap, max_tokens,
                              old_from_forward=not cfg.recompute_old_logprobs)

    @classmethod
    def from_config(cls, config: RunConfig) -> GRPOObjective:
        """The RL learner's objective: the family member `algorithm.name` names."""
        return cls(config.algorithm, max_tokens=config.rollout.max_tokens, temperature=config.rollout.temperature)

    def sequences(self, groups: list[common_pb2.TrajectoryGroup]) -> list[Sequence]:
        """One sequence per valid sample, its advantage computed within its group."""
        seqs = []
        for g in groups:
            valid = [s for s in g.samples if not s.error]
            adv = group_advantages(torch.tensor([s.reward for s in valid]), self.name)
            for s, a in zip(valid, adv.tolist()):
                seqs.append(Sequence(list(g.prompt_token_ids), list(s.completion.token_ids),
                                     list(s.completion.loss_mask), list(s.logprobs), a, g.group_id))
        return seqs

    def loss(self, logprobs_BT: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return policy_loss(logprobs_BT, micro, self.cfg)
