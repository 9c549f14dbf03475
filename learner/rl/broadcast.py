"""Learner side of the weight push: (re)build the transfer group when membership changes, then one
UpdateWeights call per rollout server per update (each server pauses, receives, loads the version, reports
its digests and resumes inside that call) while the bytes are sent. The bytes move through a transport
`Sender` (gloo or NCCL); this module only drives the control plane (weight-update protocol
`PROTOCOL_VERSION`, agreed in InitWeightTransfer: a server of another version is dropped, naming
both): each group's rendezvous (prefix and secret, or NCCL id) goes out in InitWeightTransfer, and
each worker's digest of what it received comes back in the UpdateWeights reply and is checked against
what was sent. The digest algorithm is agreed per group: weight_sync.digest_algorithm if every member
lists it in its InitWeightTransfer reply, else sha256.
In a group of at least weight_sync.announce_min_servers where every member follows announced updates,
an update is not a call per server but one entry on a Valkey stream (`services.weights.announce`):
the learner's cost of starting it no longer grows with the number of servers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc

from rlmesh.learner.rl.membership import Generator, Membership
from rlmesh.v1 import rollout_pb2
from rlmesh.services.config import WeightSyncSection
from rlmesh.services.weights.announce import LOST
from rlmesh.services.weights.base import PROTOCOL_VERSION, ProtocolMismatch, check_protocol

if TYPE_CHECKING:
    import torch

    from rlmesh.learner.trackers.metrics import MetricsWriter
    from rlmesh.services.weights.announce import UpdateAnnouncer
    from rlmesh.services.weights.base import Sender
    from rlmesh.services.weights.wire import Handoff, TensorMeta

log = logging.getLogger(__name__)

# Runs a blocking call on the learner's one torch thread (all collectives happen there).
TorchRunner = Callable[..., Awaitable[Any]]


class BroadcastError(RuntimeError):
    pass


class WeightSource:
    """What the broadcaster sends: the layout (no gather needed) and a stream of full tensors
    (a collective on every training rank, run on the torch thread)."""

    def __init__(self, metas: Callable[[], list[TensorMeta]], stream: Callable[[], Iterator[tuple[str, torch.Tensor]]]):
        self.metas, self.stream = metas, stream

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]]) -> WeightSource:
        """A source over tensors already in memory (tests, tools)."""
        from rlmesh.services.weights.wire import describe

        return cls(lambda: describe(named), lambda: iter(named))


class WeightBroadcaster:
    def __init__(self, membership: Membership, cfg: WeightSyncSection, transport: Sender,
                 run_torch: TorchRunner, announcer: UpdateAnnouncer | None = None,
                 metrics: MetricsWriter | None = None) -> None:
        self.membership, self.cfg, self.transport, self.run_torch = membership, cfg, transport, run_torch
        self.announcer = announcer
        """Where updates of large groups are announced (the run's Valkey); None: always one call per server."""
        self.metrics = metrics
        """Where each completed update is recorded (a `weights` row: version, members, digest)."""
        self.announced = False
        """Every member of this group follows the announce stream: an update is one stream entry."""
        self.epoch = 0
        self.formed = False
        self.members: list[Generator] = []
        self.formed_revision = -1  # the membership revision the group was formed at
        self.verified_versions: list[int] = []
        self.sent_versions: list[int] = []
        self.last_digest = ""
        self.digest_algorithm = "sha256"
        """The algorithm of this group's digests (and of last_digest)."""
        self._fanout: asyncio.Semaphore | None = None
        self._completing: asyncio.Future | None = None  # the last update's completion (`settled`)
        self._snapshot = None  # wire.Snapshot, the buffers weight_sync.snapshot sends from (made on first use)
        # The transfer from a snapshot runs here, never on the torch thread: the next training step
        # runs there meanwhile (its collectives are on the training group, the transfer's on the weight group).
        self._wire: ThreadPoolExecutor | None = None

    def _bounded(self, call: Callable[[], Awaitable[Any]]) -> asyncio.Future:
        """`call()` with at most weight_sync.control_concurrency such calls in flight. Only for the
        calls that do not wait on each other (dialling a channel): InitWeightTransfer and UpdateWeights
        block in a collective every member must enter, so those all go out at once."""
        if self._fanout is None:
            self._fanout = asyncio.Semaphore(self.cfg.control_concurrency)

        async def run() -> Any:
            async with self._fanout:
                return await call()

        return asyncio.ensure_future(run())

    async def _connect(self, members: list[Generator]) -> None:
        """Open the channels of members that have none yet (bounded): the first call on a channel
        dials it, and a thousand servers dialled in the same instant by InitWeightTransfer is a
        connection storm in which calls fail (CANCELLED) on both sides."""
        new = [g for g in members if not g.in_group]
        wait_s = min(self.cfg.timeout_s, 10.0)
        await asyncio.gather(*(self._bounded(lambda g=g: asyncio.wait_for(g.channel.channel_ready(), wait_s))
                               for g in new), return_exceptions=True)  # one not up fails in InitWeightTransfer

    async def _gather(self, what: str, calls: dict[str, asyncio.Future]) -> dict[str, Any]:
        """Every call's reply by rollout server id; a failed call drops its rollout server and raises."""
        results = await asyncio.gather(*calls.values(), return_exceptions=True)
        failed = {gid: r for gid, r in zip(calls, results) if isinstance(r, BaseException)}
        if failed:
            for gid, err in failed.items():
                detail = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.aio.AioRpcError) else repr(err)
                self.membership.remove(gid, f"{what} failed ({detail})")
            self.formed = False
            raise BroadcastError(f"{what} failed on {', '.join(failed)}")
        return dict(zip(calls, results))

    async def _rebuild(self) -> None:
        self.membership.expire()
        self.transport.close()
        self.epoch += 1
        revision = self.membership.revision  # who registers while the group forms is in the next one
        members = list(self.membership.generators.values())
        offset = 1  # the learner is rank 0
        for gen in members:
            gen.rank_offset, offset = offset, offset + gen.num_workers
        world = offset
        t0 = time.monotonic()
        await self._connect(members)
        ticket = self.transport.rendezvous(self.epoch)
        announce_stream = report_stream = ""
        if self.announcer is not None and len(members) >= self.cfg.announce_min_servers:
            try:
                announce_stream, report_stream = await self.announcer.open(self.epoch)
            except LOST as err:  # this group's updates go out as calls; the next group tries again
                log.warning("weight updates of group epoch %d go out as one call per server: Valkey unreachable "
                            "(%r)", self.epoch, err)
        request = lambda g: rollout_pb2.InitWeightTransferRequest(  # noqa: E731
            backend=self.cfg.backend, master_address=ticket.master_address, master_port=ticket.master_port,
            rank_offset=g.rank_offset, world_size=world, group_epoch=self.epoch, timeout_seconds=self.cfg.timeout_s,
            group_prefix=ticket.prefix, group_secret=ticket.secret, nccl_unique_id=ticket.nccl_unique_id,
            announce_stream=announce_stream, report_stream=report_stream, generator_id=g.generator_id,
            announce_public_key=self.announcer.public_key if announce_stream else b"",
            report_key=self.announcer.report_key_for(g.generator_id) if announce_stream else b"",
            protocol_version=PROTOCOL_VERSION)
        calls = {g.generator_id: asyncio.ensure_future(g.stub.InitWeightTransfer(request(g), timeout=self.cfg.timeout_s))
                 for g in members}
        try:
            await self.run_torch(self.transport.form_group, self.epoch, world)
        except Exception as err:
            await asyncio.gather(*calls.values(), return_exceptions=True)
            await self._gather("InitWeightTransfer", calls)
            raise BroadcastError(f"transfer group epoch {self.epoch} did not form: {err}") from err
        replies = await self._gather("InitWeightTransfer", calls)
        self._check_protocol(replies)
        self.digest_algorithm = self._agree_digest(replies)
        # Where every member follows the announce stream, an update is one stream entry for all of them.
        self.announced = bool(announce_stream) and all(r.announced_updates for r in replies.values())
        self.formed, self.members, self.formed_revision = True, members, revision
        for g in members:
            g.in_group = True
        log.info("%s transfer group epoch %d formed: %d rollout server(s), world size %d, digest %s, %s (%.1fs)",
                 self.cfg.backend, self.epoch, len(members), world, self.digest_algorithm,
                 "updates announced once on Valkey" if self.announced else "one UpdateWeights call per server per "
                 "update", time.monotonic() - t0)

    def _check_protocol(self, replies: dict[str, Any]) -> None:
        """Drop every member that speaks another weight-update protocol (naming both versions) and raise."""
        wrong = {}
        for gid, reply in replies.items():
            try:
                check_protocol(reply.protocol_version, f"rollout server {gid}")
            except ProtocolMismatch as err:
                wrong[gid] = str(err)
        if wrong:
            for gid, why in wrong.items():
                self.membership.remove(gid, why)
            self.formed = False
            raise BroadcastError("; ".join(wrong.values()))

    def _agree_digest(self, replies: dict[str, Any]) -> str:
        """The configured algorithm if every member can digest with it, else sha256."""
        wanted = self.cfg.digest_algorithm
        if not self.transport.verifies:
            return wanted  # nothing is digested (nccl)
        behind = [gid for gid, r in replies.items() if wanted not in r.digest_algorithms]
        if behind and wanted != "sha256":
            log.warning("weight digests fall back to sha256: %s cannot digest with weight_sync.digest_algorithm=%s "
                        "(its hash package is not installed: pip install blake3 xxhash)", ", ".join(behind), wanted)
            return "sha256"
        return wanted

    async def broadcast(self, version: int, source: WeightSource) -> dict[str, float]:
        """Push the weights as `version` to every rollout server and wait until every one has them;
        returns timing metrics."""
        metrics = await self.send(version, source)
        return {**metrics, **await self.settled()}

    async def send(self, version: int, source: WeightSource) -> dict[str, float]:
        """Push the weights as `version` to every rollout server; returns timing metrics once the bytes
        are sent (with weight_sync.snapshot, once they are copied), so that the learner's next
        training step can start. The rest (the transfer from the snapshot,
        each server's reply once it has loaded them, the digest check) completes in the
        background: `settled()` waits for it, and whatever needs every server at `version` (issuing
        prompts at it, the next update, a catch-up) must call it first. A rollout server that fails
        before the bytes are sent is dropped from membership (it re-registers) and the round is
        retried once; one that fails after is dropped and caught up when it registers again."""
        await self.settled()
        for attempt in (0, 1):
            if not self.membership.generators:
                return {"broadcast_s": 0.0, "num_generators": 0.0}
            try:
                return await self._broadcast_once(version, source)
            except BroadcastError as err:
                if attempt == 1:
                    raise
                log.warning("weight broadcast v%d failed (%s); rebuilding the group and retrying", version, err)
        raise AssertionError("unreachable")

    async def catch_up(self, version: int, source: WeightSource) -> None:
        """Bring rollout servers that hold other weights (late joiners, survivors of a learner restart)
        to `version` now, rather than after the next step: they serve nothing until then."""
        await self.settled()  # an update still completing leaves every rollout server looking behind
        if self.membership.out_of_date(version):
            await self.broadcast(version, source)

    async def settled(self) -> dict[str, float]:
        """Wait until the last update has completed on every rollout server (raises what it raised: a
        digest mismatch); its metrics, {} when there was nothing to wait for."""
        completing = self._completing
        if completing is None:
            return {}
        try:
            return await asyncio.shield(completing)
        finally:
            if completing.done() and self._completing is completing:
                self._completing = None

    async def _broadcast_once(self, version: int, source: WeightSource) -> dict[str, float]:
        t0 = time.monotonic()
        if not self.formed or self.membership.revision != self.formed_revision:
            await self._rebuild()
        members, epoch, timeout, algorithm = self.members, self.epoch, self.cfg.timeout_s, self.digest_algorithm
        metas = source.metas()
        # One request for every member (nothing in it is per server): each server pauses when its call
        # arrives and waits in the collective for the rest.
        request = rollout_pb2.UpdateWeightsRequest(
            version=version, group_epoch=epoch, digest_algorithm=algorithm, pause_mode="keep",
            tensors=[rollout_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=m.shape) for m in metas])
        if self.announced:  # one stream entry, whatever the number of members
            try:
                updates = await self._announce(request, members)
            except LOST as err:  # nothing announced: rebuild (with calls, while Valkey is away) and retry
                self.formed = False
                raise BroadcastError(f"announcing v{version} failed: Valkey unreachable ({err!r})") from err
        else:
            updates = {g.generator_id: asyncio.ensure_future(g.stub.UpdateWeights(request, timeout=timeout))
                       for g in members}
        snapshot = self.cfg.snapshot and self.transport.snapshots
        t_send = time.monotonic()
        if snapshot:  # the transfer starts on its own thread and sends each bucket once it is copied
            if self._wire is None:
                self._wire = ThreadPoolExecutor(1, thread_name_prefix="rlmesh-weights")
            from rlmesh.services.weights.wire import Handoff

            handoff = Handoff()
            digest = asyncio.get_running_loop().run_in_executor(
                self._wire, self.transport.send_flat, handoff, metas, algorithm)
        try:
            if snapshot:
                # The weights of `version` copied (a collective on every training rank, on the torch
                # thread): the transfer reads only this copy, so the next step may change the parameters.
                await self.run_torch(self._take_snapshot, source, metas, handoff)
            else:
                digest = await self.run_torch(lambda: self.transport.send(source.stream(), metas, algorithm))
        except Exception as err:
            await asyncio.gather(*updates.values(), *([digest] if snapshot else []), return_exceptions=True)
            await self._gather("UpdateWeights", updates)
            self.formed = False
            raise BroadcastError(f"{self.cfg.backend} send failed: {err}") from err
        phases = {f"broadcast_{'snapshot' if snapshot else 'send'}_s": time.monotonic() - t_send}
        self.sent_versions.append(version)
        sent = {"broadcast_mb": sum(m.nbytes for m in metas) / 2**20,
                # what the update moved to each rollout server: the whole model, or only the adapter (learner.lora)
                "broadcast_bytes": float(sum(m.nbytes for m in metas)), "num_generators": float(len(members)),
                "weights_verified": float(self.transport.verifies)}
        # With a snapshot, `digest` is the transfer's future.
        self._completing = asyncio.ensure_future(self._complete(version, digest, members, updates))
        return {"broadcast_s": time.monotonic() - t0, **phases, **sent}

    def _take_snapshot(self, source: WeightSource, metas: list[TensorMeta], handoff: Handoff) -> None:
        from rlmesh.services.weights.wire import Snapshot

        if self._snapshot is None:
            self._snapshot = Snapshot()
        try:
            self._snapshot.take(source.stream(), metas, ready=handoff.put)
        except BaseException as err:
            handoff.end(err)  # the transfer stops where the copy did, and fails
            raise
        handoff.end()

    async def _complete(self, version: int, digest: str | asyncio.Future, members: list[Generator],
                        updates: dict[str, asyncio.Future]) -> dict[str, float]:
        """The rest of an update once the bytes are sent (or, from a snapshot, while they are:
        `digest` is then the transfer's future): every server's reply (it has loaded the weights
        and resumed) and the digest check. A server whose call failed is dropped
        from membership (it registers again and is caught up to the version current then): nothing
        is re-sent as `version`, since the learner's weights may have moved on."""
        t0 = time.monotonic()
        metrics: dict[str, float] = {}
        if isinstance(digest, asyncio.Future):
            try:
                digest = await digest
            except Exception as err:
                # No server can hold `version` now: drop them all (each re-registers and is caught up).
                await asyncio.gather(*updates.values(), return_exceptions=True)
                for g in members:
                    self.membership.remove(g.generator_id, f"the {self.cfg.backend} transfer of v{version} from the "
                                                           f"snapshot failed ({err!r})")
                self.formed = False
                return {"broadcast_transfer_s": time.monotonic() - t0}
            metrics["broadcast_transfer_s"] = time.monotonic() - t0
        results = dict(zip(updates, await asyncio.gather(*updates.values(), return_exceptions=True)))
        for gid, result in results.items():
            if isinstance(result, BaseException):
                detail = (f"{result.code().name}: {result.details()}" if isinstance(result, grpc.aio.AioRpcError)
                          else repr(result))
                self.membership.remove(gid, f"UpdateWeights v{version} failed after the weights were sent ({detail})")
                self.formed = False  # the next update rebuilds the group without it
        done = [g for g in members if not isinstance(results[g.generator_id], BaseException)]
        finished = {g.generator_id: results[g.generator_id] for g in done}
        t_loaded = time.monotonic()
        mismatch = self._verify(version, digest, finished, done) if self.transport.verifies else ""
        if mismatch:
            raise RuntimeError(mismatch)  # a corrupted transfer is a bug, not a retryable fault
        self._record(version, digest, finished, done)
        return {**metrics, "broadcast_load_s": t_loaded - t0 - metrics.get("broadcast_transfer_s", 0.0),
                "broadcast_verify_s": time.monotonic() - t_loaded}

    async def _announce(self, request: rollout_pb2.UpdateWeightsRequest,
                        members: list[Generator]) -> dict[str, asyncio.Future]:
        """Announce `request` to the whole group (one entry); a future per member that ends as its
        UpdateWeights call would (its reply, or the error it reported, or a timeout), all settled by
        one background read of the reports."""
        await self.announcer.announce(request)
        loop = asyncio.get_running_loop()
        futures = {g.generator_id: loop.create_future() for g in members}
        collecting = asyncio.ensure_future(self.announcer.collect(request.version, request.group_epoch,
                                                                  set(futures), self.cfg.timeout_s))

        def settle(done: asyncio.Future) -> None:
            results = {} if done.cancelled() or done.exception() else done.result()
            for gid, fut in futures.items():
                result = results[gid] if gid in results else RuntimeError(
                    "cancelled" if done.cancelled() else f"reading the reports failed: {done.exception()!r}")
                fut.set_exception(result) if isinstance(result, BaseException) else fut.set_result(result)

        collecting.add_done_callback(settle)
        return futures

    def _record(self, version: int, digest: str, finished: dict[str, Any], members: list[Generator]) -> None:
        """`members` hold `version`, verified when the transport digests."""
        for g in members:
            g.busy_seconds = finished[g.generator_id].busy_seconds
            g.version = version
        if self.transport.verifies and members:
            self.verified_versions.append(version)
            self.last_digest = digest
        if self.metrics is not None and members:
            # Which servers hold which weights since when: a late joiner's first row is its catch-up.
            self.metrics.write({"kind": "weights", "version": version, "group_epoch": self.epoch,
                                "generators": sorted(g.generator_id for g in members), "digest": digest,
                                "digest_algorithm": self.digest_algorithm, "verified": self.transport.verifies})

    def _verify(self, version: int, digest: str, finished: dict[str, Any], members: list[Generator]) -> str:
        """"" if every worker of every one of `members` reported receiving exactly `digest`; otherwise what differs."""
        for g in members:
            reply = finished[g.generator_id]
            if reply.digest_algorithm != self.digest_algorithm:
                return (f"{g.generator_id} digested weights v{version} with {reply.digest_algorithm or '(none)'}, the "
                        f"learner with {self.digest_algorithm}; run the same rlmesh version on learner and rollout "
                        "servers")
            received = list(reply.received_digests)
            if len(received) != g.num_workers:
                return (f"{g.generator_id} reported {len(received)} worker digest(s) for v{version}, expected "
                        f"{g.num_workers}")
            for i, got in enumerate(received):
                if got != digest:
                    return (f"{g.generator_id} worker rank {g.rank_offset + i} received weights v{version} with "
                            f"digest {got[:12] or '(none)'}, sent {digest[:12]}")
        return ""
