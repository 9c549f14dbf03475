"""NCCL weight transport (GPU hosts): the learner mints each group's ncclUniqueId itself and sends
it to the rollout servers inside the authenticated InitWeightTransfer call; both sides open the
communicator from those bytes with vLLM's `PyNcclCommunicator.from_unique_id_bytes`, and the rollout
servers receive with vLLM's built-in `nccl` engine (packed broadcast, default buffer geometry on
both sides). No TCPStore is involved, so nothing is unpickled from a store. NCCL moves bytes device
to device, so there is no digest: `verifies` is False and the learner records each version as sent,
not verified. Needs CUDA and vLLM in the learner's environment.

UNVERIFIED: this path has not run on a GPU yet (the machines it was written on have none)."""

from __future__ import annotations

import base64
import ctypes
from collections.abc import Iterable

import torch

from rlmesh.services.config import WeightSyncSection
from rlmesh.services.weights.base import Rendezvous, check_init
from rlmesh.services.weights.wire import TensorMeta, buckets, unflatten
from rlmesh.v1 import rollout_pb2

ENGINE = "nccl"
"""vLLM's own NCCL weight-transfer engine."""
UNIQUE_ID_BYTES = 128


class NCCLSender:
    engine = ENGINE
    verifies = False
    snapshots = False  # the weights stay on the GPU: a CPU copy would cross PCIe twice

    def __init__(self, cfg: WeightSyncSection) -> None:
        if not torch.cuda.is_available():
            raise ValueError("weight_sync.backend=nccl needs a CUDA device on the learner; use weight_sync.backend=gloo")
        self.cfg = cfg
        self.comm = None
        self._minted: dict[int, Rendezvous] = {}

    def rendezvous(self, epoch: int) -> Rendezvous:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        unique_id = NCCLLibrary().ncclGetUniqueId()
        raw = ctypes.string_at(ctypes.addressof(unique_id.internal), UNIQUE_ID_BYTES)
        self._minted = {epoch: Rendezvous(self.cfg.master_address, 0, nccl_unique_id=raw)}
        return self._minted[epoch]

    def form_group(self, epoch: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import uid_init_process_group

        self.close()
        # No store barrier on this path: the workers enter concurrently (their InitWeightTransfer is in flight).
        self.comm = uid_init_process_group(self._minted[epoch].nccl_unique_id, 0, world_size,
                                           torch.cuda.current_device())

    def send(self, named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta],
             digest_algorithm: str = "sha256") -> str:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        assert self.comm is not None, "form_group before send"
        device = torch.device("cuda", torch.cuda.current_device())
        packed_nccl_broadcast_producer(iterator=iter(named), group=self.comm, src=0,
                                       post_iter_func=lambda item: item[1].to(device, non_blocking=True))
        torch.cuda.synchronize()
        return ""

    def send_flat(self, flats: Iterable[torch.Tensor], metas: list[TensorMeta], digest_algorithm: str = "sha256") -> str:
        return self.send((item for flat, idx in zip(flats, buckets(metas)) for item in unflatten(flat, metas, idx)),
                         metas, digest_algorithm)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None


class NCCLReceiver:
    engine = ENGINE

    def __init__(self, cfg: WeightSyncSection) -> None:
        self.cfg = cfg

    def init_info(self, request: rollout_pb2.InitWeightTransferRequest) -> dict:
        """What vLLM's `nccl` engine expects in `init_weight_transfer_engine` (unique-id rendezvous, packed)."""
        check_init(self.cfg, request)
        if len(request.nccl_unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"nccl_unique_id has {len(request.nccl_unique_id)} bytes, NCCL's is {UNIQUE_ID_BYTES}")
        return {"rank_offset": request.rank_offset, "world_size": request.world_size, "packed": True,
                "nccl_unique_id_b64": base64.b64encode(request.nccl_unique_id).decode()}

    def update_info(self, request: rollout_pb2.UpdateWeightsRequest) -> dict:
        return {"names": [t.name for t in request.tensors], "dtype_names": [t.dtype for t in request.tensors],
                "shapes": [list(t.shape) for t in request.tensors]}
