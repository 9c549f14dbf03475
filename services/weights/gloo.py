"""gloo weight transport (CPU hosts, and any host without NCCL between trainer and workers): a
ProcessGroupGloo over the learner's TCPStore, one key prefix per group epoch, bucketed broadcast,
and a digest each worker publishes in the store for the learner to check."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from rlmesh.services.config import WeightSyncSection
from rlmesh.services.weights.wire import TensorMeta, buckets, flat_buckets, unflatten

ENGINE = "rlmesh_gloo"


def _prefix(epoch: int) -> str:
    return f"rlmesh/epoch{epoch}"


def digest_key(epoch: int, version: int, rank: int) -> str:
    return f"{_prefix(epoch)}/digest/v{version}/rank{rank}"


class GlooTransport:
    engine = ENGINE
    verifies = True

    def __init__(self, cfg: WeightSyncSection) -> None:
        self.cfg = cfg
        # One master store for the learner's lifetime; each group epoch uses its own key prefix.
        self.store = dist.TCPStore(cfg.master_address, cfg.store_port, 1, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=cfg.timeout_s))
        self.group: dist.ProcessGroup | None = None

    def rendezvous(self, epoch: int) -> tuple[str, int]:
        return self.cfg.master_address, self.store.port

    def form_group(self, epoch: int, world_size: int) -> None:
        prefixed = dist.PrefixStore(_prefix(epoch), self.store)
        self.group = dist.ProcessGroupGloo(prefixed, 0, world_size, timedelta(seconds=self.cfg.timeout_s))

    def send(self, named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> str:
        assert self.group is not None, "form_group before send"
        digest, in_flight = hashlib.sha256(), None
        for flat in flat_buckets(named, metas):
            work = self.group.broadcast(flat, 0)
            # Hash while gloo's own thread moves the bucket (hashlib releases the GIL; no copy), and
            # keep two buckets in flight: the next one is flattened while this one is on the wire.
            digest.update(flat.view(torch.uint8).numpy())
            if in_flight is not None:
                in_flight.wait()
            in_flight = work
        if in_flight is not None:
            in_flight.wait()
        return digest.hexdigest()

    def verify(self, epoch: int, version: int, digest: str, ranks: list[int], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        for rank in ranks:
            key = digest_key(epoch, version, rank)
            # check() never blocks; a worker that never publishes is reported, not waited on forever.
            while not self.store.check([key]):
                if time.monotonic() > deadline:
                    return f"worker rank {rank} published no digest for v{version} within {timeout_s:.0f}s"
                time.sleep(0.01)
            got = self.store.get(key).decode()
            self.store.delete_key(key)
            if got != digest:
                return f"worker rank {rank} received weights v{version} with digest {got[:12]}, sent {digest[:12]}"
        return ""

    def close(self) -> None:
        self.group = None


# --- worker side (inside vLLM's worker process) -------------------------------------------------

def join_group(master_address: str, master_port: int, rank: int, world_size: int, epoch: int,
               timeout_s: float) -> tuple[dist.TCPStore, dist.ProcessGroup]:
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout,
                          wait_for_workers=False)
    group = dist.ProcessGroupGloo(dist.PrefixStore(_prefix(epoch), store), rank, world_size, timeout)
    return store, group


def receive(group: dist.ProcessGroup, metas: list[TensorMeta], digest: hashlib._Hash | None = None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive the broadcast bucket by bucket, yielding (name, tensor) views. The next bucket is
    already being received while the caller loads the tensors of this one."""
    in_flight = None
    for idx in buckets(metas):
        flat = torch.empty(sum(metas[i].numel for i in idx), dtype=getattr(torch, metas[idx[0]].dtype))
        work = group.broadcast(flat, 0)
        if in_flight is not None:
            yield from _received(*in_flight, metas, digest)
        in_flight = (idx, flat, work)
    if in_flight is not None:
        yield from _received(*in_flight, metas, digest)


def _received(idx: list[int], flat: torch.Tensor, work, metas: list[TensorMeta], digest: hashlib._Hash | None
              ) -> Iterator[tuple[str, torch.Tensor]]:
    work.wait()
    if digest is not None:
        digest.update(flat.view(torch.uint8).numpy())
    yield from unflatten(flat, metas, idx)
