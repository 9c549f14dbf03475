"""The weight-transport interface, both sides: a `Sender` in the learner (always rank 0 of the
transfer group) and a `Receiver` in each rollout server, one pair per transport module (`gloo`,
`nccl`), chosen by `weight_sync.backend` through `rlmesh.services.weights.build_sender` /
`build_receiver`. The learner's broadcaster drives the control plane (gRPC) around them; the
rollout server never names a transport. The received digest comes back over gRPC (in the UpdateWeights reply), never
through a store; its algorithm is agreed per group (InitWeightTransferResponse lists what a server can digest with).
Learner and rollout servers agree on one weight-update protocol, `PROTOCOL_VERSION`, when a group forms."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from rlmesh.services.config import WeightSyncSection
    from rlmesh.services.weights.wire import TensorMeta
    from rlmesh.v1 import rollout_pb2


PROTOCOL_VERSION = 2
"""The weight-update protocol: InitWeightTransfer to form a group, then one UpdateWeights per server per
update (pause, receive, load, digest, resume), or that request announced once on Valkey for a large group.
Bump it on any change either side must know about; a mismatch is refused when the group forms."""


class ProtocolMismatch(Exception):
    """The other side of a weight group speaks another weight-update protocol version."""


def check_protocol(theirs: int, who: str) -> None:
    """Raise ProtocolMismatch naming both versions unless `who` (the learner, or a rollout server) speaks ours."""
    if theirs != PROTOCOL_VERSION:
        seen = f"version {theirs}" if theirs else "no version (an rlmesh from before protocol versions)"
        raise ProtocolMismatch(f"{who} speaks weight-update protocol {seen}, this side version {PROTOCOL_VERSION}: "
                               "run the same rlmesh release on the learner and every rollout server")


@dataclass(frozen=True)
class Rendezvous:
    """How the workers join transfer group `epoch`; travels only in the authenticated
    InitWeightTransfer call."""

    master_address: str
    master_port: int
    prefix: str = ""
    """Store key prefix of the group (gloo): random, fresh each epoch."""
    secret: bytes = b""
    """Group secret (gloo): never written to the store; each rank proves it holds it."""
    nccl_unique_id: bytes = b""
    """The group's ncclUniqueId (nccl), minted by the learner."""


class Sender(Protocol):
    engine: str
    """Name the rollout server's vLLM weight-transfer engine is registered under."""
    verifies: bool
    """True if `send` returns the digest of the bytes sent, for the workers' digests to be checked against."""
    snapshots: bool
    """True if the learner may send from a CPU snapshot of the weights (`send_flat` on a thread of its own,
    weight_sync.snapshot); False sends from the weights themselves on the torch thread."""

    def rendezvous(self, epoch: int) -> Rendezvous:
        """Mint group `epoch` (its prefix and secret, or NCCL id); sent to the workers in InitWeightTransfer."""

    def form_group(self, epoch: int, world_size: int) -> None:
        """Join the new transfer group as rank 0 (blocks until every worker has joined and proved
        it holds the group's secret)."""

    def send(self, named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta],
             digest_algorithm: str = "sha256") -> str:
        """Broadcast every tensor, in `metas` order; returns the digest of what was sent in
        `digest_algorithm` ("" if the transport does not digest)."""

    def send_flat(self, flats: Iterable[torch.Tensor], metas: list[TensorMeta], digest_algorithm: str = "sha256") -> str:
        """`send` from the wire layout already built (`wire.Snapshot`: one flat tensor per bucket of `metas`)."""

    def close(self) -> None:
        """Drop the current group."""


class Receiver(Protocol):
    engine: str
    """Name of the vLLM weight-transfer engine this transport receives with."""

    def init_info(self, request: rollout_pb2.InitWeightTransferRequest) -> dict:
        """The engine's `init_weight_transfer_engine` payload. Raises PermissionError for a group
        that is not the configured learner's, ValueError for a malformed request."""

    def update_info(self, request: rollout_pb2.UpdateWeightsRequest) -> dict:
        """The engine's `update_weights` payload for the tensors the request lists."""


def check_init(cfg: WeightSyncSection, request: rollout_pb2.InitWeightTransferRequest) -> None:
    """A rollout server joins only a well-formed group of its own transport on the learner it was
    configured with: the announced address (and port, where one is fixed) must be weight_sync's."""
    if request.backend != cfg.backend:
        raise ValueError(f"backend={request.backend!r}: this server's vLLM engine receives over {cfg.backend!r}; "
                         "start learner and rollout servers with the same weight_sync.backend")
    if request.world_size < 2 or request.rank_offset < 1:
        raise ValueError(f"world_size={request.world_size} / rank_offset={request.rank_offset}: the learner is rank "
                         "0, so workers need rank_offset >= 1 and world_size >= 2")
    if request.master_address != cfg.master_address or (cfg.store_port and request.master_port != cfg.store_port):
        raise PermissionError(
            f"InitWeightTransfer names weight group {request.master_address}:{request.master_port}, but this "
            f"server only joins the learner's weight_sync.master_address={cfg.master_address!r}"
            + (f" port {cfg.store_port}" if cfg.store_port else "")
            + "; start learner and rollout servers with the same weight_sync section")


def rank_proof(secret: bytes, prefix: str, rank: int) -> bytes:
    """What rank `rank` contributes to prove it holds the group secret (bound to the group's prefix,
    so a proof seen on the wire is worthless in any other group)."""
    return hmac.new(secret, f"{prefix}/rank{rank}".encode(), hashlib.sha256).digest()
