"""Learner side of the weight push: (re)build the broadcast group when membership changes, then
pause -> start -> broadcast + UpdateWeights -> finish -> verify digests -> resume on every generator."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from learner.membership import Generator, Membership
from rlmesh.v1 import rollout_pb2
from services.config import WeightSyncSection
from services.weight_sync import describe, send

log = logging.getLogger(__name__)


class BroadcastError(RuntimeError):
    pass


class WeightBroadcaster:
    def __init__(self, membership: Membership, cfg: WeightSyncSection) -> None:
        self.membership, self.cfg = membership, cfg
        # One master store for the learner's lifetime; each group epoch uses its own key prefix.
        self.store = dist.TCPStore(cfg.master_address, cfg.store_port, 1, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=cfg.timeout_s))
        self.port = self.store.port
        self.epoch = 0
        self.group: dist.ProcessGroup | None = None
        self.members: list[Generator] = []
        self.verified_versions: list[int] = []
        self.last_digest = ""

    async def _gather(self, what: str, calls: dict[str, asyncio.Future]) -> None:
        results = await asyncio.gather(*calls.values(), return_exceptions=True)
        failed = {gid: r for gid, r in zip(calls, results) if isinstance(r, BaseException)}
        if failed:
            for gid, err in failed.items():
                detail = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else repr(err)
                self.membership.remove(gid, f"{what} failed ({detail})")
            self.group = None
            raise BroadcastError(f"{what} failed on {', '.join(failed)}")

    async def _rebuild(self) -> None:
        self.membership.expire()
        self.epoch += 1
        members = list(self.membership.generators.values())
        offset = 1
        for gen in members:
            gen.rank_offset, offset = offset, offset + gen.num_workers
        world = offset
        t0 = time.monotonic()
        request = lambda g: rollout_pb2.InitWeightTransferRequest(  # noqa: E731
            backend="gloo", master_address=self.cfg.master_address, master_port=self.port,
            rank_offset=g.rank_offset, world_size=world, group_epoch=self.epoch, timeout_seconds=self.cfg.timeout_s)
        calls = {g.generator_id: asyncio.ensure_future(g.stub.InitWeightTransfer(request(g), timeout=self.cfg.timeout_s))
                 for g in members}
        prefixed = dist.PrefixStore(f"rlmesh/epoch{self.epoch}", self.store)
        try:
            group = await asyncio.to_thread(dist.ProcessGroupGloo, prefixed, 0, world,
                                            timedelta(seconds=self.cfg.timeout_s))
        except Exception as err:
            await asyncio.gather(*calls.values(), return_exceptions=True)
            await self._gather("InitWeightTransfer", calls)
            raise BroadcastError(f"broadcast group epoch {self.epoch} did not form: {err}") from err
        await self._gather("InitWeightTransfer", calls)
        self.group, self.members = group, members
        self.membership.changed = False
        for g in members:
            g.in_group = True
        log.info("broadcast group epoch %d formed: %d generator(s), world size %d (%.1fs)",
                 self.epoch, len(members), world, time.monotonic() - t0)

    async def broadcast(self, version: int, weights: Callable[[], list[tuple[str, torch.Tensor]]]) -> dict[str, float]:
        """Push `weights()` as `version` to every generator; returns timing metrics. A generator
        that fails is dropped from membership (it re-registers) and the round is retried once."""
        for attempt in (0, 1):
            if not self.membership.generators:
                return {"broadcast_s": 0.0, "num_generators": 0.0}
            try:
                return await self._broadcast_once(version, weights)
            except BroadcastError as err:
                if attempt == 1:
                    raise
                log.warning("weight broadcast v%d failed (%s); rebuilding the group and retrying", version, err)
        raise AssertionError("unreachable")

    async def _broadcast_once(self, version: int, weights: Callable[[], list[tuple[str, torch.Tensor]]]) -> dict[str, float]:
        t0 = time.monotonic()
        if self.group is None or self.membership.changed:
            await self._rebuild()
        members, epoch, timeout = self.members, self.epoch, self.cfg.timeout_s
        each = lambda make: {g.generator_id: asyncio.ensure_future(make(g)) for g in members}  # noqa: E731

        await self._gather("PauseGeneration", each(lambda g: g.stub.PauseGeneration(
            rollout_pb2.PauseGenerationRequest(mode="keep"), timeout=timeout)))
        await self._gather("StartWeightUpdate", each(lambda g: g.stub.StartWeightUpdate(
            rollout_pb2.StartWeightUpdateRequest(version=version, group_epoch=epoch), timeout=timeout)))
        named = await asyncio.to_thread(weights)
        metas = describe(named)
        specs = [rollout_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=m.shape) for m in metas]
        updates = each(lambda g: g.stub.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(version=version, group_epoch=epoch, tensors=specs), timeout=timeout))
        t_send = time.monotonic()
        try:
            digest = await asyncio.to_thread(send, self.group, named, metas)
        except Exception as err:
            await asyncio.gather(*updates.values(), return_exceptions=True)
            await self._gather("UpdateWeights", updates)
            self.group = None
            raise BroadcastError(f"gloo broadcast failed: {err}") from err
        send_s = time.monotonic() - t_send
        await self._gather("UpdateWeights", updates)
        await self._gather("FinishWeightUpdate", each(lambda g: g.stub.FinishWeightUpdate(
            rollout_pb2.FinishWeightUpdateRequest(version=version, group_epoch=epoch), timeout=timeout)))
        mismatch = self._verify(version, digest, members)
        await self._gather("ResumeGeneration", each(lambda g: g.stub.ResumeGeneration(
            rollout_pb2.ResumeGenerationRequest(), timeout=timeout)))
        if mismatch:
            raise RuntimeError(mismatch)  # a corrupted transfer is a bug, not a retryable fault
        for g in members:
            g.version = version
        return {"broadcast_s": time.monotonic() - t0, "broadcast_send_s": send_s,
                "broadcast_mb": sum(t.numel() * t.element_size() for _, t in named) / 2**20,
                "num_generators": float(len(members))}

    def _verify(self, version: int, digest: str, members: list[Generator]) -> str:
        """Every worker published the digest of the bytes it received; they must equal ours."""
        for g in members:
            for r in range(g.rank_offset, g.rank_offset + g.num_workers):
                key = f"rlmesh/epoch{self.epoch}/digest/v{version}/rank{r}"
                got = self.store.get(key).decode()
                self.store.delete_key(key)
                if got != digest:
                    return (f"generator {g.generator_id} rank {r} received weights v{version} with "
                            f"digest {got[:12]}, learner sent {digest[:12]}")
        self.verified_versions.append(version)
        self.last_digest = digest
        return ""
