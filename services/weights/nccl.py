"""NCCL weight transport (GPU hosts): the learner opens rank 0 of a NCCL group with vLLM's own
trainer-side helpers, and the rollout servers receive with vLLM's built-in `nccl` weight-transfer
engine (packed broadcast, default buffer geometry on both sides). NCCL moves bytes device to
device, so there is no digest: `verifies` is False and the learner records each version as sent,
not verified. Needs CUDA and vLLM in the learner's environment.

UNVERIFIED: this path has not run on a GPU yet (the machines it was written on have none)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlmesh.services.config import WeightSyncSection
from rlmesh.services.ports import free_port
from rlmesh.services.weights.wire import TensorMeta

ENGINE = "nccl"


class NCCLTransport:
    engine = ENGINE
    verifies = False

    def __init__(self, cfg: WeightSyncSection) -> None:
        if not torch.cuda.is_available():
            raise ValueError("weight_sync.backend=nccl needs a CUDA device on the learner; use weight_sync.backend=gloo")
        self.cfg = cfg
        self.comm = None
        self._ports: dict[int, int] = {}

    def rendezvous(self, epoch: int) -> tuple[str, int]:
        # vLLM's StatelessProcessGroup hosts a fresh TCPStore per group on rank 0.
        port = self._ports.setdefault(epoch, self.cfg.store_port or free_port())
        return self.cfg.master_address, port

    def form_group(self, epoch: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.close()
        address, port = self.rendezvous(epoch)
        self.comm = trainer_init({"master_address": address, "master_port": port, "world_size": world_size})

    def send(self, named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> str:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        assert self.comm is not None, "form_group before send"
        device = torch.device("cuda", torch.cuda.current_device())
        packed_nccl_broadcast_producer(iterator=iter(named), group=self.comm, src=0,
                                       post_iter_func=lambda item: item[1].to(device, non_blocking=True))
        torch.cuda.synchronize()
        return ""

    def verify(self, epoch: int, version: int, digest: str, ranks: list[int], timeout_s: float) -> str:
        return ""

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None


def worker_init_info(master_address: str, master_port: int, rank_offset: int, world_size: int) -> dict:
    """What vLLM's `nccl` engine expects in `init_weight_transfer_engine` (packed, as we send)."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "packed": True}


def worker_update_info(metas: list[TensorMeta]) -> dict:
    return {"names": [m.name for m in metas], "dtype_names": [m.dtype for m in metas],
            "shapes": [list(m.shape) for m in metas]}
