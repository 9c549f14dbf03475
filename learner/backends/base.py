"""The training-backend interface: the learner drives any backend through these calls."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from learner.batch import MicroBatch

# loss_fn(logprobs_BT, micro) -> (loss scalar, metrics); logprobs are of input_ids[:, 1:].
LossFn = Callable[["torch.Tensor", "MicroBatch"], "tuple[torch.Tensor, dict[str, float]]"]


class TrainingBackend(Protocol):
    rank: int
    world_size: int

    def compute_logprobs(self, micro: MicroBatch, temperature: float) -> torch.Tensor:
        """Per-token logprobs [B, T-1] of the targets, without gradient."""

    def train_step(self, micros: list[MicroBatch], loss_fn: LossFn, temperature: float) -> dict[str, float]:
        """Accumulate gradients over `micros`, clip, step the optimizer; return averaged metrics."""

    def set_lr(self, lr: float) -> None:
        """Learning rate for the next steps."""

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every weight; a collective on every rank."""

    def save_pretrained(self, path: str) -> None:
        """Write an HF model directory (rank 0 writes)."""

    def state_dict_for_checkpoint(self) -> dict: ...

    def load_checkpoint_state(self, state: dict) -> None: ...
