"""The GRPO family as an objective: group-relative advantages from trajectory groups, and the
clipped policy-gradient loss with off-policy correction and an optional KL penalty to the frozen
starting policy (`rlmesh.learner.train.algorithms`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlmesh.learner.train.algorithms.advantages import group_advantages
from rlmesh.learner.train.algorithms.loss import LossConfig, policy_loss, step_normaliser
from rlmesh.learner.train.algorithms.off_policy import OffPolicyConfig
from rlmesh.learner.train.algorithms.turn_credit import turn_advantages
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
        self.needs_ref_logprobs = cfg.kl.coef > 0
        self.kl_in_reward = self.needs_ref_logprobs and cfg.kl.where == "reward"
        # Without a KL term, a sample of a group scored all alike trains nothing: no forward for it.
        self.skips_zero_advantage = not self.needs_ref_logprobs
        self.credit = cfg.credit
        self.kl_coef, self.kl_estimator, self.kl_clamp = cfg.kl.coef, cfg.kl.estimator, cfg.kl.clamp
        off = cfg.off_policy
        self.cfg = LossConfig(cfg.name, cfg.clip_low, cfg.clip_high, cfg.tis_cap, max_tokens,
                              old_from_forward=not cfg.recompute_old_logprobs,
                              off_policy=OffPolicyConfig(off.mode, cfg.tis_cap, off.low, off.high, off.seq_ratio),
                              kl_coef=cfg.kl.coef, kl_estimator=cfg.kl.estimator, kl_clamp=cfg.kl.clamp,
                              kl_in_loss=self.needs_ref_logprobs and cfg.kl.where == "loss")

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
            per_token = ([None] * len(valid) if self.credit.assign == "episode" else
                         turn_advantages(g, valid, self.name, self.credit.assign, discount=self.credit.discount,
                                         state_weight=self.credit.state_weight))
            for s, a, tokens in zip(valid, adv.tolist(), per_token):
                seqs.append(Sequence(list(g.prompt_token_ids), list(s.completion.token_ids),
                                     list(s.completion.loss_mask), list(s.logprobs), a, g.group_id, s.reward,
                                     token_advantages=tokens))
        return seqs

    def reshape_advantages(self, seqs: list[Sequence], kl_B: torch.Tensor) -> None:
        """reward - kl_coef * KL, then the group-relative advantages again (groups are contiguous)."""
        start = 0
        while start < len(seqs):
            stop = start
            while stop < len(seqs) and seqs[stop].group_key == seqs[start].group_key:
                stop += 1
            rewards = torch.tensor([s.reward for s in seqs[start:stop]]) - self.kl_coef * kl_B[start:stop].float()
            for s, a in zip(seqs[start:stop], group_advantages(rewards, self.name).tolist()):
                s.advantage = a
            start = stop

    def part_scale(self, seqs: list[Sequence]) -> float:
        """What a step trained in parts (`accumulate_part`: normalisers of 1) multiplies its gradient by
        once every part of `seqs`, the whole step, is in: the step's normaliser divided out."""
        num_tokens = float(sum(sum(1 for m in s.loss_mask if m) for s in seqs)) or 1.0
        return step_normaliser(self.cfg, 1.0, 1.0) / step_normaliser(self.cfg, float(len(seqs)), num_tokens)

    def loss(self, logprobs_BT: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return policy_loss(logprobs_BT, micro, self.cfg)
