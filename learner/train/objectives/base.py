"""The objective interface, and the one step function every objective trains through.

An objective turns what the controller collected (trajectory groups, SFT examples, preference
pairs) into `Sequence`s on rank 0, and supplies the loss every rank computes on its share. The
step itself (sharding, micro-batches, old logprobs, optimizer) is common to all objectives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from rlmesh.learner.train.backends.base import TrainingBackend
    from rlmesh.learner.train.batch import MicroBatch, Sequence


class Objective(Protocol):
    name: str
    needs_old_logprobs: bool
    """Recompute the learner's own logprobs (pi_old) before the step, for ratio-based losses."""

    def loss(self, logprobs_BT: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch, normalised by the whole step's counts (micro-batch invariant)."""


def run_step(backend: TrainingBackend, objective: Objective, seqs: list[Sequence], *, micro_batch_size: int,
             pad_id: int, temperature: float, lr: float) -> dict[str, float]:
    """One optimizer step over the whole batch `seqs`; called on every rank with the same `seqs`."""
    from rlmesh.learner.train.batch import plan_step

    # Shard by data-parallel rank: tensor/pipeline-parallel peers must see the same micro-batches.
    micros = plan_step(seqs, micro_batch_size, pad_id, getattr(backend, "dp_rank", backend.rank),
                       getattr(backend, "dp_size", backend.world_size))
    if objective.needs_old_logprobs:
        for m in micros:
            m.old_logprobs_BT = backend.compute_logprobs(m, temperature)
    backend.set_lr(lr)
    return {**backend.train_step(micros, objective.loss, temperature), "lr": lr}


def build_objective(name: str, config) -> Objective:
    """The objective for a run: `sft`, `dpo`, or the GRPO family member `algorithm.name` names."""
    if name == "sft":
        from rlmesh.learner.train.objectives.sft import SFTObjective

        return SFTObjective()
    if name == "dpo":
        from rlmesh.learner.train.objectives.dpo import DPOObjective

        return DPOObjective(config.dpo.beta, config.dpo.sft_weight)
    from rlmesh.learner.train.objectives.grpo import GRPOObjective

    return GRPOObjective(config.algorithm, max_tokens=config.rollout.max_tokens)
