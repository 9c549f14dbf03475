"""The weight-transport interface: how the learner (always rank 0 of the transfer group) ships a
policy version to every inference worker. One module per transport (`gloo`, `nccl`), chosen by
`weight_sync.backend`; the learner's broadcaster drives the control plane (gRPC) around it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from rlmesh.services.config import WeightSyncSection
    from rlmesh.services.weights.wire import TensorMeta


class WeightTransport(Protocol):
    engine: str
    """Name the rollout server's vLLM weight-transfer engine is registered under."""
    verifies: bool
    """True if `verify` proves, by digest, that every worker received exactly what was sent."""

    def rendezvous(self, epoch: int) -> tuple[str, int]:
        """(address, port) the workers of group `epoch` dial; sent to them in InitWeightTransfer."""

    def form_group(self, epoch: int, world_size: int) -> None:
        """Join the new transfer group as rank 0 (blocks until every worker has joined)."""

    def send(self, named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> str:
        """Broadcast every tensor, in `metas` order; returns the sha256 of what was sent ("" if the
        transport does not digest)."""

    def verify(self, epoch: int, version: int, digest: str, ranks: list[int], timeout_s: float) -> str:
        """"" if every worker rank received `digest`; otherwise what differs. Bounded by `timeout_s`."""

    def close(self) -> None:
        """Drop the current group."""


def build_transport(cfg: WeightSyncSection) -> WeightTransport:
    if cfg.backend == "gloo":
        from rlmesh.services.weights.gloo import GlooTransport

        return GlooTransport(cfg)
    if cfg.backend == "nccl":
        from rlmesh.services.weights.nccl import NCCLTransport

        return NCCLTransport(cfg)
    raise ValueError(f"weight_sync.backend={cfg.backend!r}; choose gloo or nccl")
