"""The objective interface, and the one step function every objective trains through.

An objective turns what its loop collected (trajectory groups, SFT examples, preference pairs)
into `Sequence`s on rank 0, and supplies the loss every rank computes on its share. The step
itself (sharding, micro-batches, old logprobs, optimizer) is common to all objectives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from rlmesh.learner.train.backends.base import TrainingBackend
    from rlmesh.learner.train.batch import MicroBatch, Sequence


class Objective(Protocol):
    name: str
    needs_old_logprobs: bool
    """Recompute the learner's own logprobs (pi_old) before the step, for ratio-based losses."""
    temperature: float
    """Temperature the policy's logprobs are taken at: the sampling temperature for RL, 1 for data."""

    def sequences(self, batch: list[Any]) -> list[Sequence]:
        """One step's sequences from what the loop collected (rank 0 only): trajectory groups for
        the GRPO family, dataset examples for SFT and DPO."""

    def loss(self, logprobs_BT: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch, normalised by the whole step's counts (micro-batch invariant)."""


def run_step(backend: TrainingBackend, objective: Objective, seqs: list[Sequence], *, micro_batch_size: int,
             pad_id: int, lr: float) -> dict[str, float]:
    """One optimizer step over the whole batch `seqs`; called on every rank with the same `seqs`."""
    from rlmesh.learner.train.batch import plan_step

    # Shard by data-parallel rank: tensor/pipeline-parallel peers must see the same micro-batches.
    micros = plan_step(seqs, micro_batch_size, pad_id, backend.dp_rank, backend.dp_size)
    if objective.needs_old_logprobs:
        for m in micros:
            m.old_logprobs_BT = backend.compute_logprobs(m, objective.temperature)
    backend.set_lr(lr)
    return {**backend.train_step(micros, objective.loss, objective.temperature), "lr": lr}
