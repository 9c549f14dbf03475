"""The training-backend interface: the learner drives any backend (FSDP2 today, Megatron-core
next) through these calls, on every rank, from one torch thread per process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from rlmesh.learner.train.batch import MicroBatch
    from rlmesh.services.weights.wire import TensorMeta

# loss_fn(logprobs_BT, micro) -> (loss scalar, metrics); logprobs are of input_ids[:, 1:].
LossFn = Callable[["torch.Tensor", "MicroBatch"], "tuple[torch.Tensor, dict[str, float]]"]


class TrainingBackend(Protocol):
    rank: int
    world_size: int
    dp_rank: int
    """This rank's index among data-parallel replicas: which share of a step's batch it trains."""
    dp_size: int
    """Data-parallel replicas; tensor/pipeline-parallel peers are one replica and train the same micro-batches."""

    def compute_logprobs(self, micro: MicroBatch, temperature: float) -> torch.Tensor:
        """Per-token logprobs [B, T-1] of the targets, without gradient, on CPU."""

    def reference_logprobs(self, micro: MicroBatch, temperature: float) -> torch.Tensor:
        """Like `compute_logprobs`, from the frozen starting policy (the KL reference); a collective."""

    def train_step(self, micros: list[MicroBatch], loss_fn: LossFn, temperature: float) -> dict[str, float]:
        """Accumulate gradients over this rank's `micros` (normalisers span the whole step on all
        ranks), so the update equals a single-rank step over every rank's micro-batches; clip, step
        the optimizer. Returns metrics reduced over all ranks: `loss` (summed), `grad_norm`, and
        the loss function's metrics averaged over real (non-padding) micro-batches."""

    def set_lr(self, lr: float) -> None:
        """Learning rate for the next steps."""

    def weight_metas(self) -> list[TensorMeta]:
        """HF name, dtype and full shape of every weight, in `full_weights` order; no communication."""

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one at a time: a collective that every rank must run to the end."""

    def save_pretrained(self, path: str) -> None:
        """Write an HF model directory (rank 0 writes; a collective)."""

    def save_checkpoint(self, path: Path) -> None:
        """Sharded model + optimizer state (torch.distributed.checkpoint); a collective."""

    def load_checkpoint(self, path: Path) -> None:
        """Restore `save_checkpoint`'s state, on any number of ranks; a collective."""
