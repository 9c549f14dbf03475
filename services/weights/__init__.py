"""Learner -> rollout weight transports (gloo, NCCL) and the wire layout they share. Each transport
is a module with both sides of the interface in `base`; `build_sender` / `build_receiver` pick one
by `weight_sync.backend`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlmesh.services.config import WeightSyncSection
    from rlmesh.services.weights.base import Receiver, Sender


def _transport(backend: str) -> tuple[type, type]:
    if backend == "gloo":
        from rlmesh.services.weights.gloo import GlooReceiver, GlooSender

        return GlooSender, GlooReceiver
    if backend == "nccl":
        from rlmesh.services.weights.nccl import NCCLReceiver, NCCLSender

        return NCCLSender, NCCLReceiver
    raise ValueError(f"weight_sync.backend={backend!r}; choose gloo or nccl")


def build_sender(cfg: WeightSyncSection) -> Sender:
    return _transport(cfg.backend)[0](cfg)


def build_receiver(cfg: WeightSyncSection) -> Receiver:
    return _transport(cfg.backend)[1](cfg)
