"""The weight-broadcast wire shared by the learner (rank 0, sender) and every inference worker:
a gloo process group over a TCPStore rendezvous, tensors flattened into dtype-homogeneous buckets
broadcast in a fixed order, and a digest of the bytes so receivers can prove they got what was
sent. Imports torch: never import this from config or contract code."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def describe(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]


def buckets(metas: list[TensorMeta], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive runs of same-dtype tensors up to `bucket_bytes` each (both sides compute this
    from the same metadata, so the split agrees)."""
    out: list[list[int]] = []
    size = 0
    for i, m in enumerate(metas):
        nbytes = m.numel * getattr(torch, m.dtype).itemsize
        if out and metas[out[-1][0]].dtype == m.dtype and size + nbytes <= bucket_bytes:
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size = nbytes
    return out


def store_and_group(
    master_address: str, master_port: int, rank: int, world_size: int, epoch: int, timeout_s: float
) -> tuple[dist.TCPStore, dist.ProcessGroup]:
    """Rendezvous: rank 0 hosts the TCPStore; the prefix keeps epochs apart on one store."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore(f"rlmesh/epoch{epoch}", store)
    group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return store, group


def _flat_buckets(named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> Iterator[torch.Tensor]:
    """Each bucket's tensors, on CPU, concatenated into one flat tensor (the wire layout)."""
    tensors = [t.detach().to("cpu").contiguous() for _, t in named]
    for idx in buckets(metas):
        yield torch.cat([tensors[i].reshape(-1) for i in idx]) if len(idx) > 1 else tensors[idx[0]].reshape(-1)


def weights_digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 over the weights in broadcast order and layout (equals `send`'s digest)."""
    digest = hashlib.sha256()
    for flat in _flat_buckets(named, describe(named)):
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def send(group: dist.ProcessGroup, named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> str:
    """Broadcast every tensor from rank 0; returns the digest of what was sent."""
    digest = hashlib.sha256()
    for flat in _flat_buckets(named, metas):
        group.broadcast(flat, 0).wait()
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def receive(group: dist.ProcessGroup, metas: list[TensorMeta], digest: hashlib._Hash | None = None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive the broadcast bucket by bucket, yielding (name, tensor) views."""
    for idx in buckets(metas):
        dtype = getattr(torch, metas[idx[0]].dtype)
        flat = torch.empty(sum(metas[i].numel for i in idx), dtype=dtype)
        group.broadcast(flat, 0).wait()
        if digest is not None:
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        offset = 0
        for i in idx:
            m = metas[i]
            yield m.name, flat[offset : offset + m.numel].view(m.shape)
            offset += m.numel
