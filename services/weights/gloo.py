"""gloo weight transport (CPU hosts, and any host without NCCL between trainer and workers): a
ProcessGroupGloo over the learner's TCPStore, bucketed broadcast with two buckets in flight, and a
digest of the bytes on both sides (BLAKE3, or sha256 where that package is missing), taken on a side thread.

The store is the weak spot (c10d stores have no authentication, and `list_keys` shows every key
to whoever dials them), so: it listens only on the interface rollout servers dial; each group lives
under a random prefix, fresh per epoch; and every rank proves, before any weight moves, that it
holds the group secret that came in the authenticated InitWeightTransfer call and was never
written to the store. A rank that cannot is refused by all the others."""

from __future__ import annotations

import collections
import contextlib
import hmac
import os
import secrets
import socket
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from rlmesh.services.config import WeightSyncSection
from rlmesh.services.weights.base import Rendezvous, check_init, rank_proof
from rlmesh.services.weights.wire import (
    BackgroundDigest,
    TensorMeta,
    WireBuffers,
    bucket_buffer,
    buckets,
    flat_buckets,
    installed_digests,
    unflatten,
)
from rlmesh.v1 import rollout_pb2

ENGINE = "rlmesh_gloo"
"""The vLLM weight-transfer engine that receives this transport (rlmesh.rollout_server.weight_engine)."""


def listen(address: str, port: int) -> socket.socket:
    """A listening socket on `address` alone (TCPStore's own listener takes every interface)."""
    errors = []
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(address, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as err:
            sock.close()
            errors.append(f"{sockaddr[0]}: {err.strerror}")
            continue
        sock.listen(128)
        return sock
    raise ValueError(f"weight_sync: the rendezvous store cannot listen on {address}:{port} ({'; '.join(errors)}); "
                     "weight_sync.master_address must name an interface of the learner's host, or set "
                     "weight_sync.bind_address to the local interface rollout servers reach it on (e.g. the pod IP "
                     "where master_address is a Service name)")


class GlooSender:
    engine = ENGINE
    verifies = True
    snapshots = True

    def __init__(self, cfg: WeightSyncSection) -> None:
        self.cfg = cfg
        bind = cfg.bind_address or cfg.master_address
        sock = listen(bind, cfg.store_port)
        host, port = sock.getsockname()[:2]
        # One master store for the learner's lifetime, on our socket; each group epoch has its own prefix.
        # The store owns the descriptor from here (it closes it when it stops): the Python socket lets
        # go of it, or collecting that object would close the number again, by then perhaps another
        # store's listener or event loop.
        fd = sock.detach()
        try:
            self.store = dist.TCPStore("127.0.0.1" if host in ("0.0.0.0", "::") else host, port, 1, is_master=True,
                                       wait_for_workers=False, master_listen_fd=fd,
                                       timeout=timedelta(seconds=cfg.timeout_s))
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        self.group: dist.ProcessGroup | None = None
        self._minted: dict[int, Rendezvous] = {}

    def rendezvous(self, epoch: int) -> Rendezvous:
        self._minted = {epoch: Rendezvous(self.cfg.master_address, self.store.port,
                                          prefix=f"rlmesh/{secrets.token_hex(16)}/epoch{epoch}",
                                          secret=secrets.token_bytes(32))}
        return self._minted[epoch]

    def form_group(self, epoch: int, world_size: int) -> None:
        ticket = self._minted[epoch]
        self.group = join(self.store, ticket, 0, world_size, self.cfg.timeout_s)
        # Every rank has connected (the proofs went round), so the group's rendezvous keys are done
        # with: drop them, and a stranger listing the store sees the prefix only while a group forms.
        for key in self.store.list_keys():
            if key.startswith(ticket.prefix + "/"):
                self.store.delete_key(key)

    def send(self, named: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta],
             digest_algorithm: str = "sha256") -> str:
        return self.send_flat(flat_buckets(named, metas), metas, digest_algorithm)

    def send_flat(self, flats: Iterable[torch.Tensor], metas: list[TensorMeta], digest_algorithm: str = "sha256") -> str:
        assert self.group is not None, "form_group before send"
        digest, in_flight = BackgroundDigest(digest_algorithm), None
        try:
            for flat in flats:
                work = self.group.broadcast(flat, 0)
                # Hashed on the digest thread while gloo's own thread moves the bucket (no copy), and
                # two buckets in flight: the next one is flattened while this one is on the wire.
                digest.update(flat)
                if in_flight is not None:
                    in_flight.wait()
                in_flight = work
            if in_flight is not None:
                in_flight.wait()
        except BaseException:
            digest.close()
            raise
        return digest.hexdigest()

    def close(self) -> None:
        self.group = None


class GlooReceiver:
    engine = ENGINE

    def __init__(self, cfg: WeightSyncSection) -> None:
        self.cfg = cfg
        self.digest_algorithms = installed_digests()

    def init_info(self, request: rollout_pb2.InitWeightTransferRequest) -> dict:
        check_init(self.cfg, request)
        if not request.group_prefix or len(request.group_secret) < 16:
            raise ValueError("InitWeightTransfer carries no group_prefix, or a group_secret under 16 bytes: a "
                             "gloo group needs both")
        return dict(master_address=request.master_address, master_port=request.master_port,
                    rank_offset=request.rank_offset, world_size=request.world_size, group_epoch=request.group_epoch,
                    group_prefix=request.group_prefix, group_secret=request.group_secret.hex(),
                    timeout_seconds=request.timeout_seconds or self.cfg.timeout_s)

    def update_info(self, request: rollout_pb2.UpdateWeightsRequest) -> dict:
        if request.digest_algorithm and request.digest_algorithm not in self.digest_algorithms:
            raise ValueError(f"UpdateWeights digest_algorithm={request.digest_algorithm!r}: this server digests with "
                             f"{', '.join(self.digest_algorithms)}; run the same rlmesh version on learner and "
                             "rollout servers")
        return dict(version=request.version, digest_algorithm=request.digest_algorithm or "sha256",
                    names=[t.name for t in request.tensors],
                    dtype_names=[t.dtype for t in request.tensors], shapes=[list(t.shape) for t in request.tensors])


# --- both sides ---------------------------------------------------------------------------------

def join(store: dist.Store, ticket: Rendezvous, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """Join group `ticket` as `rank`, then check that every rank holds the group secret (one
    allgather of 32-byte proofs): whoever slipped into the store's rendezvous without it is found
    here, before any weight is sent or loaded."""
    group = dist.ProcessGroupGloo(dist.PrefixStore(ticket.prefix, store), rank, world_size,
                                  timedelta(seconds=timeout_s))
    mine = torch.frombuffer(bytearray(rank_proof(ticket.secret, ticket.prefix, rank)), dtype=torch.uint8)
    proofs = [torch.empty_like(mine) for _ in range(world_size)]
    group.allgather([proofs], [mine]).wait()
    strangers = [r for r, proof in enumerate(proofs)
                 if not hmac.compare_digest(proof.numpy().tobytes(), rank_proof(ticket.secret, ticket.prefix, r))]
    if strangers:
        raise PermissionError(f"weight group {ticket.prefix.rsplit('/', 1)[-1]}: rank(s) {strangers} do not hold the "
                              "group secret (a stranger joined through the rendezvous store); refusing the group")
    return group


# --- worker side (inside vLLM's worker process) -------------------------------------------------

def join_group(ticket: Rendezvous, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    store = dist.TCPStore(ticket.master_address, ticket.master_port, world_size, is_master=False,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return join(store, ticket, rank, world_size, timeout_s)


def receive(group: dist.ProcessGroup, metas: list[TensorMeta], digest: BackgroundDigest | None = None,
            into: WireBuffers | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive the broadcast bucket by bucket, yielding (name, tensor) views. The first buckets are
    posted before this returns (the caller may do other work while they arrive), and later buckets
    are being received, and this one digested on `digest`'s thread, while the caller loads the
    tensors of this one. With `into`, the buckets land in its buffers (kept for the next update:
    the caller must be done with this update's views by then) instead of fresh ones, and every
    bucket is posted at once (the buffers exist anyway): a caller slower than the wire never holds
    the sender back. Without, two are in flight."""
    flats = into.of(metas) if into is not None else None
    plan = list(enumerate(buckets(metas)))
    ahead = len(plan) if flats is not None else 2
    in_flight: collections.deque = collections.deque()

    def post(b: int, idx: list[int]) -> None:
        flat = flats[b] if flats is not None else bucket_buffer(metas, idx)
        in_flight.append((idx, flat, group.broadcast(flat, 0)))

    for b, idx in plan[:ahead]:
        post(b, idx)

    def drain() -> Iterator[tuple[str, torch.Tensor]]:
        for b, idx in plan[ahead:]:
            yield from _received(*in_flight.popleft(), metas, digest)
            post(b, idx)
        while in_flight:
            yield from _received(*in_flight.popleft(), metas, digest)

    return drain()


def _received(idx: list[int], flat: torch.Tensor, work, metas: list[TensorMeta], digest: BackgroundDigest | None
              ) -> Iterator[tuple[str, torch.Tensor]]:
    work.wait()
    if digest is not None:
        digest.update(flat)
    yield from unflatten(flat, metas, idx)
