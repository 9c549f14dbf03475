"""The training-backend interface: the learner drives any backend (FSDP2 today, Megatron-core
next) through these calls, on every rank, from one torch thread per process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from rlmesh.learner.train.batch import MicroBatch
    from rlmesh.services.weights.wire import TensorMeta

# loss_fn(logprobs_BT, micro) -> (loss scalar, metrics); logprobs are of input_ids[:, 1:].
LossFn = Callable[["torch.Tensor", "MicroBatch"], "tuple[torch.Tensor, dict[str, float]]"]


@dataclass
class Accumulated:
    """What a step's forward and backward passes so far returned on this rank (`accumulate`)."""

    num_real: float = 0.0
    """Real (non-padding) micro-batches."""
    loss_sum: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)
    """The loss function's metrics summed over real micro-batches."""

    def add(self, is_padding: bool, loss: float, metrics: dict[str, float]) -> None:
        real = 0.0 if is_padding else 1.0
        self.num_real += real
        self.loss_sum += loss
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + real * v


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

    streams: bool
    """Whether a step can be trained in parts as its data arrives: `zero_grad`, then `accumulate`
    once per part, then `finish` (False: `train_step` only)."""

    def zero_grad(self) -> None:
        """Start a step trained in parts: no gradient held."""

    def accumulate(self, micros: list[MicroBatch], loss_fn: LossFn, temperature: float,
                   into: Accumulated | None = None) -> Accumulated:
        """Forward and backward over this rank's `micros`, the gradient added to what the step holds
        (every rank runs the same number of micro-batches per call); the losses and metrics added to `into`."""

    def finish(self, acc: Accumulated, scale: float) -> dict[str, float]:
        """Multiply the step's gradient and loss by `scale` (its normaliser, where the parts were
        trained without it), clip, step the optimizer; metrics as `train_step` returns them."""

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
