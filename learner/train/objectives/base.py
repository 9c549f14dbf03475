"""The objective interface, and the one step function every objective trains through.

An objective turns what its loop collected (trajectory groups, SFT examples, preference pairs)
into `Sequence`s on rank 0, and supplies the loss every rank computes on its share. The step
itself (sharding, micro-batches, old logprobs, optimizer) is common to all objectives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from rlmesh.services.config import LearnerSection, default

if TYPE_CHECKING:
    import torch

    from rlmesh.learner.train.backends.base import Accumulated, TrainingBackend
    from rlmesh.learner.train.batch import MicroBatch, Sequence


class Objective(Protocol):
    name: str
    needs_old_logprobs: bool
    """Recompute the learner's own logprobs (pi_old) before the step, for ratio-based losses."""
    needs_ref_logprobs: bool
    """Compute the frozen reference policy's logprobs (`micro.ref_logprobs_BT`) before the step (KL penalty)."""
    kl_in_reward: bool
    """The KL penalty goes into the rewards: `reshape_advantages` is called with each sequence's KL before the step
    (such an objective also names its `kl_estimator`, k1, k2 or k3, and `kl_clamp`)."""
    temperature: float
    """Temperature the policy's logprobs are taken at: the sampling temperature for RL, 1 for data."""
    skips_zero_advantage: bool
    """A sequence whose advantage is zero everywhere adds nothing to the loss or its gradient (a
    policy-gradient loss with no KL term), so the step leaves it out of its forward and backward
    (`plan_step`'s skip_zero_advantage); it still counts in the step's normalisers."""

    def sequences(self, batch: list[Any]) -> list[Sequence]:
        """One step's sequences from what the loop collected (rank 0 only): trajectory groups for
        the GRPO family, dataset examples for SFT and DPO."""

    def reshape_advantages(self, seqs: list[Sequence], kl_B: torch.Tensor) -> None:
        """Subtract the penalty from each sequence's reward and recompute the advantages (only where
        `kl_in_reward`); `kl_B` is each sequence's summed KL estimate, in `seqs` order, on every rank."""

    def loss(self, logprobs_BT: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch, normalised by the whole step's counts (micro-batch invariant)."""


def run_step(backend: TrainingBackend, objective: Objective, seqs: list[Sequence], *, micro_batch_size: int,
             pad_id: int, lr: float,
             max_tokens_per_micro_batch: int = default(LearnerSection, "max_tokens_per_micro_batch"),
             shared_prompt_row_tokens: int = default(LearnerSection, "shared_prompt_row_tokens")) -> dict[str, float]:
    """One optimizer step over the whole batch `seqs`; called on every rank with the same `seqs`."""
    from rlmesh.learner.train.batch import plan_step

    # Shard by data-parallel rank: tensor/pipeline-parallel peers must see the same micro-batches.
    micros = plan_step(seqs, micro_batch_size, pad_id, backend.dp_rank, backend.dp_size,
                       max_tokens=max_tokens_per_micro_batch, shared_row_tokens=shared_prompt_row_tokens,
                       skip_zero_advantage=objective.skips_zero_advantage)
    _before_training(backend, objective, micros)
    extra = reward_kl(backend, objective, seqs, micros) if objective.kl_in_reward else {}
    backend.set_lr(lr)
    return {**backend.train_step(micros, objective.loss, objective.temperature), **extra, "lr": lr}


def _before_training(backend: TrainingBackend, objective: Objective, micros: list[MicroBatch]) -> None:
    """The no-grad forwards a loss needs before its own: pi_old recomputed, the reference's logprobs."""
    if objective.needs_old_logprobs:
        for m in micros:
            m.old_logprobs_BT = backend.compute_logprobs(m, objective.temperature)
    if objective.needs_ref_logprobs:
        for m in micros:
            m.ref_logprobs_BT = backend.reference_logprobs(m, objective.temperature)


def accumulate_part(backend: TrainingBackend, objective: Objective, seqs: list[Sequence], acc: Accumulated, *,
                    micro_batch_size: int, pad_id: int,
                    max_tokens_per_micro_batch: int = default(LearnerSection, "max_tokens_per_micro_batch"),
                    shared_prompt_row_tokens: int = default(LearnerSection, "shared_prompt_row_tokens")) -> Accumulated:
    """Forward and backward over one part of a step trained in parts (a backend that `streams`; an
    objective whose penalty does not reshape advantages across the step): the part's micro-batches
    carry normalisers of 1, so the gradient held is the step's summed loss's; the caller divides it by
    the whole step's normaliser in `backend.finish`. Called on every rank with the same `seqs`."""
    from rlmesh.learner.train.batch import plan_step

    assert backend.streams and not objective.kl_in_reward, "this step cannot be trained in parts"
    micros = plan_step(seqs, micro_batch_size, pad_id, backend.dp_rank, backend.dp_size,
                       max_tokens=max_tokens_per_micro_batch, shared_row_tokens=shared_prompt_row_tokens,
                       skip_zero_advantage=objective.skips_zero_advantage)
    for m in micros:
        m.num_loss_tokens_in_step = m.num_seqs_in_step = 1.0
    _before_training(backend, objective, micros)
    return backend.accumulate(micros, objective.loss, objective.temperature, acc)


def reward_kl(backend: TrainingBackend, objective: Objective, seqs: list[Sequence],
              micros: list[MicroBatch]) -> dict[str, float]:
    """Each sequence's KL(behaviour || reference) summed over its loss tokens (the policy that
    sampled it, so no extra forward), gathered from every data-parallel rank; the objective turns it
    into a reward penalty and new advantages, the same on every rank, written into `micros`."""
    import torch
    import torch.distributed as dist

    from rlmesh.learner.train.algorithms.kl import kl_estimate

    kl_B = torch.zeros(len(seqs), dtype=torch.float64)
    for m in micros:
        if m.is_padding:
            continue
        kl_BT = kl_estimate(m.behaviour_logprobs_BT, m.ref_logprobs_BT, objective.kl_estimator, objective.kl_clamp)
        kl_B[m.seq_index_B] = (kl_BT * m.loss_mask_BT).sum(-1).double()
    if backend.dp_size > 1:
        # Each sequence lives on one rank; the others hold 0 for it. Data-parallel ranks only:
        # tensor-parallel peers hold the same rows (FSDP2, the one backend with a reference, is all data-parallel).
        assert backend.dp_size == backend.world_size, "reward KL needs a data-parallel-only backend"
        reduced = kl_B.cuda() if torch.cuda.is_available() else kl_B  # NCCL reduces GPU tensors only
        dist.all_reduce(reduced)
        kl_B = reduced.cpu()
    objective.reshape_advantages(seqs, kl_B)
    for m in micros:
        if not m.is_padding:
            m.advantages_B = torch.tensor([seqs[i].advantage for i in m.seq_index_B], dtype=torch.float32)
    num_tokens = sum(sum(1 for x in s.loss_mask if x) for s in seqs) or 1
    return {"kl_ref": float(kl_B.sum()) / num_tokens}
