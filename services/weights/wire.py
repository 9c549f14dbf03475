"""The weight wire layout every transport shares: tensor metadata in a fixed order, grouped into
dtype-homogeneous buckets that sender, receiver and digest all compute from the same metadata, and
the digests both sides take of those bytes. Imports torch: never import this from config or
contract code."""

from __future__ import annotations

import hashlib
import os
import queue
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

BUCKET_BYTES = 64 * 1024 * 1024

DIGEST_ALGORITHMS = ("blake3", "xxh3", "sha256")
"""What a gloo receiver can digest with, preferred first (InitWeightTransferResponse.digest_algorithms).
BLAKE3 is cryptographic like sha256 and 2-4x faster on one core; xxh3 (128-bit) is another ~5x faster
but not cryptographic: it catches corruption, not a forger on the weight network (opt-in,
weight_sync.digest_algorithm); sha256 is for a peer without those packages."""


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

    @property
    def nbytes(self) -> int:
        return self.numel * getattr(torch, self.dtype).itemsize


def describe(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    return [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]


def buckets(metas: list[TensorMeta], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Consecutive runs of same-dtype tensors up to `bucket_bytes` each (both sides compute this
    from the same metadata, so the split agrees)."""
    out: list[list[int]] = []
    size = 0
    for i, m in enumerate(metas):
        if out and metas[out[-1][0]].dtype == m.dtype and size + m.nbytes <= bucket_bytes:
            out[-1].append(i)
            size += m.nbytes
        else:
            out.append([i])
            size = m.nbytes
    return out


def flat_buckets(named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> Iterator[torch.Tensor]:
    """Each bucket's tensors, on CPU, concatenated into one flat tensor (the wire layout). Streams:
    `named` is consumed one tensor at a time and at most one bucket is held, so a sender that
    gathers full tensors on the fly never keeps a second full copy of the model."""
    it = iter(named)
    for idx in buckets(metas):
        parts = []
        for i in idx:
            parts.append(_in_layout(next(it), metas[i]).to("cpu").reshape(-1))
        yield torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def _in_layout(item: tuple[str, torch.Tensor], m: TensorMeta) -> torch.Tensor:
    name, tensor = item
    if name != m.name or tuple(tensor.shape) != m.shape:
        raise ValueError(f"weight stream out of order: got {name} {tuple(tensor.shape)}, layout says "
                         f"{m.name} {m.shape}")
    return tensor.detach()


def bucket_buffer(metas: list[TensorMeta], idx: list[int]) -> torch.Tensor:
    """An uninitialised flat CPU tensor for the bucket of tensors `idx` (its dtype and total size)."""
    return torch.empty(sum(metas[i].numel for i in idx), dtype=getattr(torch, metas[idx[0]].dtype))


class WireBuffers:
    """One flat CPU tensor per bucket of a layout, kept across updates: writing into them again
    costs a copy, not fresh pages (allocating and first touching them cost more than the copy)."""

    def __init__(self) -> None:
        self.metas: list[TensorMeta] = []
        self.flats: list[torch.Tensor] = []

    def of(self, metas: list[TensorMeta]) -> list[torch.Tensor]:
        """The buffers for `metas`, made anew only when the layout changed (the first update, or the
        adapter's shape changed)."""
        if metas != self.metas:
            self.flats = [bucket_buffer(metas, idx) for idx in buckets(metas)]
            self.metas = list(metas)
        return self.flats


class Snapshot(WireBuffers):
    """The weights in the wire layout, in buffers kept across updates: taking it copies every byte
    once, and from then on the source may change (the next training step) while the copy is sent.
    Costs a second copy of what is sent in memory."""

    def take(self, named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta],
             ready: Callable[[torch.Tensor], None] | None = None) -> list[torch.Tensor]:
        """Copy `named` (streamed in `metas` order) into the buffers, handing each bucket to `ready`
        as soon as it is copied (the sender starts on it while the next is copied); returns them,
        one per bucket. Valid until the next `take`."""
        it = iter(named)
        flats = self.of(metas)
        for flat, idx in zip(flats, buckets(metas)):
            offset = 0
            for i in idx:
                m = metas[i]
                flat[offset : offset + m.numel].view(m.shape).copy_(_in_layout(next(it), m))
                offset += m.numel
            if ready is not None:
                ready(flat)
        for _ in it:  # let a generator source run to its end (it may close a collective on other ranks)
            raise ValueError("weight stream has more tensors than the layout lists")
        return flats


class Handoff:
    """Buckets passed in order from the thread that copies them (`put`, then `end`) to the thread
    that sends them (iterating); a copy that fails part-way ends with its error, which the sender's
    iteration raises."""

    _END = object()

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, flat: torch.Tensor) -> None:
        self._queue.put(flat)

    def end(self, error: BaseException | None = None) -> None:
        self._queue.put(self._END if error is None else error)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while (item := self._queue.get()) is not self._END:
            if isinstance(item, BaseException):
                raise RuntimeError(f"the weight snapshot failed part-way ({item!r})") from item
            yield item


def installed_digests() -> tuple[str, ...]:
    """The DIGEST_ALGORITHMS this process can compute (a receiver advertises only these)."""
    import importlib.util

    return tuple(a for a in DIGEST_ALGORITHMS
                 if a == "sha256" or importlib.util.find_spec({"xxh3": "xxhash"}.get(a, a)) is not None)


def new_digest(algorithm: str, threads: int | None = None):
    """A hashlib-style digest object; "" is sha256 (what a peer that names no algorithm means).
    `threads`: how many BLAKE3 may hash on (default: one per core); the others take one."""
    if algorithm in ("", "sha256"):
        return hashlib.sha256()
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(max_threads=threads or blake3.blake3.AUTO)
    if algorithm == "xxh3":
        import xxhash

        return xxhash.xxh3_128()
    raise ValueError(f"digest algorithm {algorithm!r} is not one of {', '.join(DIGEST_ALGORITHMS)} "
                     "(weight_sync.digest_algorithm); run the same rlmesh version on learner and rollout servers")


class BackgroundDigest:
    """Digests buckets in order on one side thread, so hashing bucket i overlaps sending, receiving
    or loading the next (every hash library here releases the GIL on large buffers). A submitted
    bucket must not change until `hexdigest` returns."""

    def __init__(self, algorithm: str = "sha256", cores: set[int] | None = None) -> None:
        """`cores`: where the side thread (and BLAKE3's own threads, one per core) run; default: where
        the thread that made it does, BLAKE3 on every core."""
        self.algorithm = algorithm or "sha256"
        self._digest = new_digest(self.algorithm, threads=len(cores) if cores else None)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rlmesh-digest",
                                        initializer=None if cores is None else os.sched_setaffinity,
                                        initargs=() if cores is None else (0, cores))
        self._pending: list[Future] = []

    def update(self, flat: torch.Tensor) -> None:
        self._pending.append(self._pool.submit(self._digest.update, flat.view(torch.uint8).numpy()))

    def hexdigest(self) -> str:
        """Waits for every bucket submitted so far (raising what hashing raised)."""
        try:
            for work in self._pending:
                work.result()
        finally:
            self._pending.clear()
            self._pool.shutdown(wait=True)
        return self._digest.hexdigest()

    def close(self) -> None:
        """Drop whatever is still queued (after a failed transfer)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def weights_digest(named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta] | None = None,
                   algorithm: str = "sha256") -> str:
    """Digest over the weights in wire order and layout (equals what a verifying transport sends
    with the same algorithm)."""
    if metas is None:
        named = list(named)
        metas = describe(named)
    digest = new_digest(algorithm)
    for flat in flat_buckets(named, metas):
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def unflatten(flat: torch.Tensor, metas: list[TensorMeta], idx: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) for each tensor of one received bucket."""
    offset = 0
    for i in idx:
        m = metas[i]
        yield m.name, flat[offset : offset + m.numel].view(m.shape)
        offset += m.numel
