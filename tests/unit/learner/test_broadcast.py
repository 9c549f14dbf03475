"""The broadcaster and the rollout servicer over real gRPC on loopback and a real two-rank gloo
group, with a stand-in for vLLM's engine that receives exactly as the gloo engine does (join with
the group secret, bucketed receive, digest of the bytes in the update's algorithm): the digest each
worker reports in its UpdateWeights reply is what the learner verifies, an update is one call per
server, a server that cannot digest with the configured algorithm gets sha256, and a foreign weight
group, or one of another weight-update protocol version, is refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

torch = pytest.importorskip("torch")

from rlmesh.learner.rl.broadcast import WeightBroadcaster, WeightSource  # noqa: E402
from rlmesh.learner.rl.membership import Membership  # noqa: E402
from rlmesh.rollout_server.service import RolloutService  # noqa: E402
from rlmesh.services.config import WeightSyncSection  # noqa: E402
from rlmesh.services.grpc_server import start_server  # noqa: E402
from rlmesh.services.weights import build_receiver, build_sender  # noqa: E402
from rlmesh.services.weights.base import PROTOCOL_VERSION, Rendezvous  # noqa: E402
from rlmesh.services.weights.gloo import join_group, receive  # noqa: E402
from rlmesh.services.weights.wire import BackgroundDigest, TensorMeta, weights_digest  # noqa: E402
from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402


class StandInEngine:
    """The part of VLLMGenerator the weight RPCs use; the model is a dict of received tensors."""

    def __init__(self, report: str | None = None, only_sha256: bool = False) -> None:
        self.report, self.group, self.weights, self.digest, self.version = report, None, {}, "", 0
        self.only_sha256, self.algorithm = only_sha256, ""
        self.calls: list[str] = []  # pause / resume, in order
        self.busy = SimpleNamespace(seconds=0.0)

    async def init_weight_transfer(self, info: dict, group_epoch: int) -> None:
        ticket = Rendezvous(info["master_address"], info["master_port"], info["group_prefix"],
                            bytes.fromhex(info["group_secret"]))
        self.group = await asyncio.to_thread(join_group, ticket, info["rank_offset"], info["world_size"],
                                             info["timeout_seconds"])

    async def update_weights(self, info: dict) -> None:
        metas = [TensorMeta(n, d, tuple(s)) for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"])]
        self.algorithm = "sha256" if self.only_sha256 else info["digest_algorithm"]
        digest = BackgroundDigest(self.algorithm)
        self.weights = await asyncio.to_thread(lambda: {n: t.clone() for n, t in receive(self.group, metas, digest)})
        self.digest = digest.hexdigest()

    async def received_digests(self) -> list[str]:
        return [self.report if self.report is not None else self.digest]

    async def finish_weight_update(self, version: int) -> None:
        self.version = version

    async def start_weight_update(self) -> None: ...
    async def pause(self, mode: str) -> None:
        self.calls.append(f"pause {mode}")

    async def resume(self) -> None:
        self.calls.append("resume")


class CountingRolloutService(RolloutService):
    """Today's rollout server, counting the weight RPCs it is sent."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.received: list[str] = []

    async def InitWeightTransfer(self, request, context):
        self.received.append("init")
        return await super().InitWeightTransfer(request, context)

    async def UpdateWeights(self, request, context):
        self.received.append("update")
        return await super().UpdateWeights(request, context)


class OtherProtocolRolloutService(RolloutService):
    """A rollout server that joins the group but answers with another weight-update protocol version."""

    async def InitWeightTransfer(self, request, context):
        reply = await super().InitWeightTransfer(request, context)
        reply.protocol_version = PROTOCOL_VERSION + 1
        return reply


class Rows(list):
    """The metrics writer's part the broadcaster uses: each record, in order."""

    def write(self, record: dict) -> None:
        self.append(record)


async def _plane(engine: StandInEngine, service_cls=RolloutService, metrics: Rows | None = None, **weight_sync):
    cfg = WeightSyncSection(backend="gloo", timeout_s=20, **weight_sync)
    service = service_cls(engine, "gen", build_receiver(cfg))
    server = await start_server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, service,
                                  "rlmesh.v1.RolloutService")], port=0)
    server.rollout_service = service
    membership = Membership(token=None, rpc_timeout_s=20)
    membership.register("gen", f"127.0.0.1:{server.port}", num_workers=1)
    broadcaster = WeightBroadcaster(membership, cfg, build_sender(cfg), lambda fn, *a: asyncio.to_thread(fn, *a),
                                    metrics=metrics)
    return server, membership, broadcaster


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("w", torch.randn(64, 8, generator=g)), ("b", torch.randn(8, generator=g)), ("n", torch.arange(6))]


async def test_the_learner_verifies_the_digest_each_worker_reports_over_grpc():
    engine, rows = StandInEngine(), Rows()
    server, _, broadcaster = await _plane(engine, metrics=rows)
    try:
        for version in (1, 2):
            named = _named(version)
            metrics = await broadcaster.broadcast(version, WeightSource.of(named))
            assert metrics["weights_verified"] == 1.0 and broadcaster.verified_versions[-1] == version
            assert broadcaster.digest_algorithm == engine.algorithm == "blake3"
            assert broadcaster.last_digest == engine.digest == weights_digest(named, algorithm="blake3")
            assert all(torch.equal(engine.weights[n], t) for n, t in named) and engine.version == version
            # Each completed update is a `weights` row in metrics.jsonl: who holds which weights, verified.
            assert rows[-1] == {"kind": "weights", "version": version, "group_epoch": 1, "generators": ["gen"],
                                "digest": engine.digest, "digest_algorithm": "blake3", "verified": True}
        assert broadcaster.epoch == 1 and len(rows) == 2  # one group, two updates
        # Paused and resumed around each update, inside its one call.
        assert engine.calls == ["pause keep", "resume"] * 2
    finally:
        await server.stop(0)


async def test_an_update_is_one_control_call_per_server():
    engine = StandInEngine()
    server, _, broadcaster = await _plane(engine, CountingRolloutService)
    try:
        for version in (1, 2):
            named = _named(version)
            await broadcaster.broadcast(version, WeightSource.of(named))
            assert broadcaster.verified_versions[-1] == version and engine.version == version
            assert all(torch.equal(engine.weights[n], t) for n, t in named)
        assert server.rollout_service.received == ["init", "update", "update"]
        assert engine.calls == ["pause keep", "resume"] * 2
    finally:
        await server.stop(0)


async def test_a_server_that_registers_while_a_group_forms_is_caught_up_by_the_next_update():
    """A rollout server restarted (or joining) while the learner forms a group for another one: the group
    is formed without it, and the catch-up that follows must form a new one with it. (Seen in the compose
    test: the crashed server re-registered while the joiner's group formed; the learner cleared its
    'membership changed' flag once that group formed, so the restarted server waited for weights for
    the rest of the run, 140 steps.)"""
    engine, late_engine = StandInEngine(), StandInEngine()
    server, membership, broadcaster = await _plane(engine)
    late = await start_server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                                RolloutService(late_engine, "late", build_receiver(broadcaster.cfg)),
                                "rlmesh.v1.RolloutService")], port=0)
    connect = broadcaster._connect

    async def connect_then_register(members):
        await connect(members)
        if "late" not in membership.generators:  # registers while the group of `gen` forms
            membership.register("late", f"127.0.0.1:{late.port}", num_workers=1)
    broadcaster._connect = connect_then_register
    try:
        await broadcaster.broadcast(1, WeightSource.of(_named(1)))
        assert engine.version == 1 and late_engine.version == 0  # formed before it registered
        assert [g.generator_id for g in membership.out_of_date(1)] == ["late"]
        await broadcaster.catch_up(1, WeightSource.of(_named(1)))
        assert late_engine.version == 1 and not membership.out_of_date(1)
        assert sorted(g.generator_id for g in broadcaster.members) == ["gen", "late"] and broadcaster.epoch == 2
    finally:
        await server.stop(0)
        await late.stop(0)


async def test_a_rollout_server_of_another_protocol_version_is_dropped_naming_both(caplog):
    server, membership, broadcaster = await _plane(StandInEngine(), OtherProtocolRolloutService)
    try:
        # The run goes on without it (a server that re-registers is tried again at the next update).
        metrics = await broadcaster.broadcast(1, WeightSource.of(_named(1)))
        assert metrics["num_generators"] == 0.0 and "gen" not in membership.generators
        assert broadcaster.verified_versions == [] and not broadcaster.formed
        assert (f"rollout server gen left: rollout server gen speaks weight-update protocol version "
                f"{PROTOCOL_VERSION + 1}, this side version {PROTOCOL_VERSION}") in caplog.text
    finally:
        await server.stop(0)


@pytest.mark.parametrize("theirs", [0, PROTOCOL_VERSION + 1])
async def test_the_rollout_service_refuses_a_learner_of_another_protocol_version(theirs):
    engine = StandInEngine()
    server, membership, _ = await _plane(engine)
    try:
        request = rollout_pb2.InitWeightTransferRequest(
            backend="gloo", master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2,
            group_epoch=1, group_prefix="rlmesh/feed/epoch1", group_secret=b"k" * 32, protocol_version=theirs)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await membership.generators["gen"].stub.InitWeightTransfer(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"this side version {PROTOCOL_VERSION}" in err.value.details()
        assert ("no version" if theirs == 0 else f"version {theirs}") in err.value.details()
        assert engine.group is None  # refused before dialling anything
    finally:
        await server.stop(0)


class SlowFinishEngine(StandInEngine):
    """Finishes an update only once the test lets it (a server still loading the last weights)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release = asyncio.Event()

    async def finish_weight_update(self, version: int) -> None:
        await self.release.wait()
        await super().finish_weight_update(version)


async def test_send_returns_once_the_bytes_are_sent_and_settled_waits_for_every_server():
    engine = SlowFinishEngine()
    server, membership, broadcaster = await _plane(engine)
    gen = membership.generators["gen"]
    try:
        named = _named(1)
        metrics = await asyncio.wait_for(broadcaster.send(1, WeightSource.of(named)), 10)
        # The learner may train on: the bytes are out, but nothing counts as held or verified yet.
        assert metrics["num_generators"] == 1.0 and broadcaster.sent_versions == [1]
        assert broadcaster.verified_versions == [] and gen.version == 0 and engine.version == 0
        waiting = asyncio.ensure_future(broadcaster.settled())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        engine.release.set()
        assert set(await asyncio.wait_for(waiting, 10)) == {"broadcast_transfer_s", "broadcast_load_s",
                                                             "broadcast_verify_s"}
        assert broadcaster.verified_versions == [1] and gen.version == 1 == engine.version
        assert broadcaster.last_digest == weights_digest(named, algorithm="blake3")
        assert await broadcaster.settled() == {}  # nothing left to wait for
    finally:
        await server.stop(0)


@pytest.mark.parametrize("snapshot", [True, False])
async def test_a_server_that_fails_after_the_send_is_dropped_and_nothing_is_resent(snapshot):
    engine = SlowFinishEngine()
    server, membership, broadcaster = await _plane(engine, snapshot=snapshot)
    try:
        await broadcaster.send(1, WeightSource.of(_named(1)))
        # From a snapshot, send() returns before the bytes move; this is about a server that has them.
        for _ in range(200):
            if engine.weights:
                break
            await asyncio.sleep(0.05)
        assert engine.weights
        await server.stop(0)  # the server goes away before it answers
        await asyncio.wait_for(broadcaster.settled(), 20)
        assert "gen" not in membership.generators and not broadcaster.formed
        assert broadcaster.sent_versions == [1] and broadcaster.verified_versions == []
    finally:
        await server.stop(0)


class LateEngine(StandInEngine):
    """Enters the receive a while after its UpdateWeights arrives (a server finishing an engine step)."""

    async def update_weights(self, info: dict) -> None:
        await asyncio.sleep(0.5)
        await super().update_weights(info)


@pytest.mark.parametrize("snapshot", [True, False])
async def test_the_weights_that_arrive_are_those_of_the_version_even_when_the_next_step_changes_them(snapshot):
    engine = LateEngine()
    server, _, broadcaster = await _plane(engine, snapshot=snapshot)
    try:
        for version in (1, 2):
            g = torch.Generator().manual_seed(version)
            # 16 MiB in one tensor: more than loopback socket buffers take, so the transfer is still
            # waiting on the late receiver when send() returns (and would read changed parameters).
            params = [("big", torch.randn(4 * 2**20, generator=g)), ("w", torch.randn(64, 8, generator=g)),
                      ("n", torch.arange(6))]
            sent = [(n, t.clone()) for n, t in params]
            metrics = await broadcaster.send(version, WeightSource.of(params))
            if snapshot:  # the training step may start while the bytes still move
                assert "broadcast_snapshot_s" in metrics and not broadcaster._completing.done()
            with torch.no_grad():
                for _, t in params:
                    t.add_(1)  # the next training step, in place
            settled = await asyncio.wait_for(broadcaster.settled(), 20)
            assert ("broadcast_transfer_s" in settled) == snapshot
            assert broadcaster.verified_versions[-1] == version and engine.version == version
            assert broadcaster.last_digest == engine.digest == weights_digest(sent, algorithm="blake3")
            assert all(torch.equal(engine.weights[n], t) for n, t in sent)
    finally:
        await server.stop(0)


async def test_a_rollout_server_without_the_configured_digest_is_sent_and_verified_with_sha256():
    engine = StandInEngine(only_sha256=True)
    server, _, broadcaster = await _plane(engine)
    server.rollout_service.weights.receiver.digest_algorithms = ("sha256",)  # no blake3 package there
    try:
        named = _named(1)
        metrics = await broadcaster.broadcast(1, WeightSource.of(named))
        assert metrics["weights_verified"] == 1.0 and broadcaster.digest_algorithm == "sha256"
        assert broadcaster.last_digest == engine.digest == weights_digest(named, algorithm="sha256")
    finally:
        await server.stop(0)


async def test_a_worker_that_digests_in_another_algorithm_than_agreed_fails_the_round_loudly():
    engine = StandInEngine(only_sha256=True)  # lists blake3 but digests with sha256 and says nothing
    server, _, broadcaster = await _plane(engine)
    try:
        with pytest.raises(RuntimeError, match="gen worker rank 1 received weights v1 with digest"):
            await broadcaster.broadcast(1, WeightSource.of(_named(1)))
        assert broadcaster.verified_versions == []
    finally:
        await server.stop(0)


async def test_a_worker_that_received_other_bytes_fails_the_round_loudly():
    server, _, broadcaster = await _plane(StandInEngine(report="f" * 64))
    try:
        with pytest.raises(RuntimeError, match="gen worker rank 1 received weights v1 with digest ffffffffffff"):
            await broadcaster.broadcast(1, WeightSource.of(_named(1)))
        assert broadcaster.verified_versions == []
    finally:
        await server.stop(0)


async def test_the_rollout_service_refuses_a_weight_group_on_a_foreign_master():
    engine = StandInEngine()
    server, membership, _ = await _plane(engine)
    try:
        request = rollout_pb2.InitWeightTransferRequest(
            backend="gloo", master_address="203.0.113.9", master_port=29500, rank_offset=1, world_size=2,
            group_epoch=1, group_prefix="rlmesh/feed/epoch1", group_secret=b"k" * 32,
            protocol_version=PROTOCOL_VERSION)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await membership.generators["gen"].stub.InitWeightTransfer(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "weight_sync.master_address='127.0.0.1'" in err.value.details()
        assert engine.group is None  # refused before dialling anything
    finally:
        await server.stop(0)
