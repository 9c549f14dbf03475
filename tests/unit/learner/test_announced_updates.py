"""Announced weight updates (`services.weights.announce`): the broadcaster writes one Valkey stream
entry per update and the real rollout servicer, following it, runs its single-call update path and
reports back, over a real Valkey, real gRPC on loopback (for InitWeightTransfer) and a real gloo
group. Also what a stranger can do to the two streams: nothing without the Valkey password, and
with it, an unsigned, forged, malformed or oversized entry is ignored (no server moves, no report counts)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac

import pytest

torch = pytest.importorskip("torch")

from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError  # noqa: E402

from rlmesh.learner.rl.broadcast import WeightBroadcaster, WeightSource  # noqa: E402
from rlmesh.learner.rl.membership import Membership  # noqa: E402
from rlmesh.rollout_server.service import RolloutService  # noqa: E402
from rlmesh.services.config import WeightSyncSection  # noqa: E402
from rlmesh.services.grpc_server import start_server  # noqa: E402
from rlmesh.services.queue import connect  # noqa: E402
from rlmesh.services.valkey import EMBEDDED_USER, start_embedded_valkey  # noqa: E402
from rlmesh.services.weights.announce import (  # noqa: E402
    MAC_FIELD, MAX_REPORT_BYTES, REPORT_FIELD, SIGNATURE_FIELD, UPDATE_FIELD, UpdateAnnouncer, follow_updates)
from rlmesh.services.weights import build_receiver, build_sender  # noqa: E402
from rlmesh.services.weights.wire import weights_digest  # noqa: E402
from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from tests.unit.learner.test_broadcast import StandInEngine  # noqa: E402


class Engine(StandInEngine):
    """The broadcast tests' stand-in engine (receives over gloo), optionally failing to finish."""

    def __init__(self, fail_finish: bool = False) -> None:
        super().__init__()
        self.fail_finish = fail_finish

    async def finish_weight_update(self, version: int) -> None:
        if self.fail_finish:
            raise RuntimeError("the engine failed to finish the update")
        await super().finish_weight_update(version)


class CountingService(RolloutService):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_update_calls = 0

    async def UpdateWeights(self, request, context):
        self.num_update_calls += 1
        return await super().UpdateWeights(request, context)


async def _plane(valkey_url: str, engine: Engine, *, min_servers: int = 1, server_queue: bool = True):
    cfg = WeightSyncSection(backend="gloo", timeout_s=20, announce_min_servers=min_servers)
    queue = connect(valkey_url)
    service = CountingService(engine, "gen", build_receiver(cfg), queue=queue if server_queue else None)
    server = await start_server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, service,
                                  "rlmesh.v1.RolloutService")], port=0)
    membership = Membership(token=None, rpc_timeout_s=20)
    membership.register("gen", f"127.0.0.1:{server.port}", num_workers=1)
    broadcaster = WeightBroadcaster(membership, cfg, build_sender(cfg), lambda fn, *a: asyncio.to_thread(fn, *a),
                                    announcer=UpdateAnnouncer(queue, prefix="test:weights"))
    return server, service, membership, broadcaster


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("w", torch.randn(32, 8, generator=g)), ("b", torch.randn(8, generator=g))]


async def test_an_announced_update_reaches_and_is_verified_on_the_server_without_a_call(valkey_url):
    engine = Engine()
    server, service, membership, broadcaster = await _plane(valkey_url, engine)
    try:
        for version in (1, 2):
            named = _named(version)
            await broadcaster.broadcast(version, WeightSource.of(named))
            assert broadcaster.announced and broadcaster.verified_versions[-1] == version
            assert broadcaster.last_digest == engine.digest == weights_digest(named, algorithm="blake3")
            assert all(torch.equal(engine.weights[n], t) for n, t in named)
            assert engine.version == version == membership.generators["gen"].version
        assert service.num_update_calls == 0  # the update came off the stream
    finally:
        await server.stop(0)


@pytest.mark.parametrize("min_servers,server_queue", [(2, True), (1, False)])
async def test_small_groups_and_servers_without_valkey_keep_one_call_per_server(valkey_url, min_servers, server_queue):
    engine = Engine()
    server, service, _, broadcaster = await _plane(valkey_url, engine, min_servers=min_servers,
                                                   server_queue=server_queue)
    try:
        await broadcaster.broadcast(1, WeightSource.of(_named(1)))
        assert not broadcaster.announced
        assert service.num_update_calls == 1 and broadcaster.verified_versions == [1]
    finally:
        await server.stop(0)


async def test_a_server_whose_announced_update_fails_is_dropped_and_nothing_is_verified(valkey_url):
    server, _, membership, broadcaster = await _plane(valkey_url, Engine(fail_finish=True))
    try:
        await broadcaster.broadcast(1, WeightSource.of(_named(1)))
        assert "gen" not in membership.generators and not broadcaster.formed
        assert broadcaster.sent_versions == [1] and broadcaster.verified_versions == []
    finally:
        await server.stop(0)


class GatedEngine(Engine):
    """Finishes the first update only once `release` is set (a server slow to load, or to report)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def finish_weight_update(self, version: int) -> None:
        if version == 1:
            await self.release.wait()
        await super().finish_weight_update(version)


async def test_the_next_announced_update_goes_out_before_the_slowest_report_of_the_last_but_not_two_ahead(valkey_url):
    engine = GatedEngine()
    server, _, membership, broadcaster = await _plane(valkey_url, engine)
    try:
        await broadcaster.broadcast(0, WeightSource.of(_named(0)))  # the group forms; updates announced from here
        assert broadcaster.announced
        sent = {v: _named(v) for v in (1, 2, 3)}
        await asyncio.wait_for(broadcaster.send(1, WeightSource.of(sent[1])), 10)
        # v1 is not loaded, let alone reported: the learner still sends v2 (UPDATES_IN_FLIGHT).
        await asyncio.wait_for(broadcaster.send(2, WeightSource.of(sent[2])), 10)
        assert engine.version == 0 and broadcaster.verified_versions == [0]
        third = asyncio.ensure_future(broadcaster.send(3, WeightSource.of(sent[3])))
        await asyncio.sleep(1.0)
        assert not third.done()  # two incomplete already: v3 waits for v1's reports
        engine.release.set()
        await asyncio.wait_for(third, 20)
        await asyncio.wait_for(broadcaster.settled(), 20)
        # Every version held and verified, in order, on the server and in the learner's books.
        assert broadcaster.verified_versions == [0, 1, 2, 3] and engine.version == 3
        assert membership.generators["gen"].version == 3
        assert broadcaster.last_digest == engine.digest == weights_digest(sent[3], algorithm="blake3")
    finally:
        await server.stop(0)


async def _report(queue, announcer: UpdateAnnouncer, gid: str, version: int, epoch: int) -> None:
    """`gid`'s signed report of update `version` (its reply's num_tensors = version), as a follower writes it."""
    data = rollout_pb2.UpdateWeightsReport(generator_id=gid, version=version, group_epoch=epoch,
                                           reply=rollout_pb2.UpdateWeightsResponse(num_tensors=version))
    data = data.SerializeToString()
    await queue.xadd(announcer.report_key, {REPORT_FIELD: data,
                                            MAC_FIELD: hmac.new(announcer.report_key_for(gid), data,
                                                                hashlib.sha256).digest()})


async def test_reports_of_the_next_update_read_while_collecting_the_last_are_kept_for_it(valkey_url):
    queue = connect(valkey_url)
    announcer = UpdateAnnouncer(queue, prefix="test:ahead")
    await announcer.open(4)
    for version in (7, 8):
        await announcer.announce(rollout_pb2.UpdateWeightsRequest(version=version, group_epoch=4))

    report = lambda gid, version: _report(queue, announcer, gid, version, epoch=4)  # noqa: E731

    await report("a", 7)
    await report("a", 8)  # a is quick: its v8 report is on the stream before b's v7
    await report("b", 7)
    first = await announcer.collect(7, 4, {"a", "b"}, timeout_s=5)
    assert first["a"].num_tensors == first["b"].num_tensors == 7
    await report("b", 8)
    second = await announcer.collect(8, 4, {"a", "b"}, timeout_s=2)
    assert second["a"].num_tensors == second["b"].num_tensors == 8
    # A member taken out of `waiting` (dropped meanwhile) is not waited for, and not reported on.
    await announcer.announce(rollout_pb2.UpdateWeightsRequest(version=9, group_epoch=4))
    await report("a", 9)
    third = await asyncio.wait_for(announcer.collect(9, 4, {"a", "b"}, timeout_s=30, waiting={"a"}), 10)
    assert set(third) == {"a"}
    await queue.aclose()


async def test_a_report_that_comes_before_its_announce_call_returns_is_kept(valkey_url):
    """A quick server reads the entry and reports before the learner's XADD call has returned; the
    collect of the update before reads that report meanwhile, and must keep it for its own."""
    queue = connect(valkey_url)
    announcer = UpdateAnnouncer(queue, prefix="test:quick")
    await announcer.open(2)
    await announcer.announce(rollout_pb2.UpdateWeightsRequest(version=1, group_epoch=2))

    report = lambda gid, version: _report(queue, announcer, gid, version, epoch=2)  # noqa: E731

    first = asyncio.ensure_future(announcer.collect(1, 2, {"a", "b"}, timeout_s=10))
    await report("a", 1)
    pipeline = queue.pipeline

    def quick_pipeline(*args, **kwargs):
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        async def execute_then_quick_report():
            result = await execute()
            await report("a", 2)  # a answered v2 before the announce call returned
            await asyncio.sleep(0.5)  # ... and the collect of v1 has read it
            return result

        pipe.execute = execute_then_quick_report
        return pipe

    queue.pipeline = quick_pipeline
    await announcer.announce(rollout_pb2.UpdateWeightsRequest(version=2, group_epoch=2))
    queue.pipeline = pipeline
    await report("b", 1)
    assert (await first)["b"].num_tensors == 1
    await report("b", 2)
    second = await announcer.collect(2, 2, {"a", "b"}, timeout_s=2)
    assert second["a"].num_tensors == 2 and second["b"].num_tensors == 2
    await queue.aclose()


async def test_forged_malformed_and_oversized_reports_are_ignored(valkey_url):
    queue = connect(valkey_url)
    announcer = UpdateAnnouncer(queue, prefix="test:forged")
    _, reports = await announcer.open(3)
    good = rollout_pb2.UpdateWeightsReport(generator_id="a", version=7, group_epoch=3).SerializeToString()
    # Reports in a's name saying its update failed: counted, they would replace a's good report.
    forged = rollout_pb2.UpdateWeightsReport(generator_id="a", version=7, group_epoch=3,
                                             error="forged: a's update failed").SerializeToString()
    mac = lambda key, data=good: hmac.new(key, data, hashlib.sha256).digest()  # noqa: E731
    for fields in ({REPORT_FIELD: good, MAC_FIELD: mac(announcer.report_key_for("a"))},  # a's own, first
                   {REPORT_FIELD: b"\xff\x00not a protobuf"},  # malformed
                   {REPORT_FIELD: b"\x00" * (MAX_REPORT_BYTES + 1)},  # oversized
                   {b"x": good},  # no report field
                   {REPORT_FIELD: rollout_pb2.UpdateWeightsReport(generator_id="stranger", version=7,
                                                                  group_epoch=3).SerializeToString()},
                   {REPORT_FIELD: rollout_pb2.UpdateWeightsReport(generator_id="b", version=7,
                                                                  group_epoch=2).SerializeToString()},  # old group
                   {REPORT_FIELD: forged},  # unsigned
                   {REPORT_FIELD: forged, MAC_FIELD: b"\x00" * 32},  # a made-up MAC
                   {REPORT_FIELD: forged, MAC_FIELD: mac(announcer.report_key_for("b"), forged)},  # b in a's name
                   {REPORT_FIELD: forged, MAC_FIELD: mac(announcer.report_key_for("a"))}):  # a's MAC of other bytes
        await queue.xadd(reports, fields)
    got = await announcer.collect(7, 3, {"a", "b"}, timeout_s=0.5)
    assert isinstance(got["a"], rollout_pb2.UpdateWeightsResponse)
    assert isinstance(got["b"], TimeoutError) and "weight_sync.timeout_s" in str(got["b"])
    await queue.aclose()


async def test_unsigned_and_forged_announcements_are_ignored_a_bad_signed_one_is_answered_with_an_error(valkey_url):
    queue = connect(valkey_url)
    announcer = UpdateAnnouncer(queue, prefix="test:malformed")
    updates, reports = await announcer.open(5)
    init = rollout_pb2.InitWeightTransferRequest(group_epoch=5, generator_id="g", announce_stream=updates,
                                                 report_stream=reports, announce_public_key=announcer.public_key,
                                                 report_key=announcer.report_key_for("g"))
    stranger = UpdateAnnouncer(queue, prefix="test:stranger-key")  # a key of its own, not the group's
    stranger.announce_key = updates
    applied: list[int] = []

    async def apply(request):
        applied.append(request.version)
        return rollout_pb2.UpdateWeightsResponse(num_tensors=len(request.tensors))

    follower = asyncio.create_task(follow_updates(queue, init, apply, block_ms=100))
    try:
        await queue.xadd(updates, {UPDATE_FIELD: b"\xff\xff garbage"})  # unsigned: ignored, no report
        await queue.xadd(updates, {UPDATE_FIELD: b"\xff" * 10, SIGNATURE_FIELD: b"\x00" * 64})  # forged signature
        step = rollout_pb2.UpdateWeightsRequest(
            version=2, group_epoch=5, tensors=[rollout_pb2.TensorSpec(name="w", dtype="float32", shape=[1])])
        await stranger.announce(step)  # well formed, signed by another key: ignored
        await announcer.announce(rollout_pb2.UpdateWeightsRequest(version=1, group_epoch=4))  # signed, wrong group
        await announcer.announce(step)
        got = await announcer.collect(2, 5, {"g"}, timeout_s=10)
        assert got["g"].num_tensors == 1 and applied == [2]  # nothing but the group's signed update reached it
        raw = await queue.xrange(reports)
        errors = [rollout_pb2.UpdateWeightsReport.FromString(f[REPORT_FIELD]).error for _, f in raw]
        assert len(errors) == 2 and "group epoch 4" in errors[0] and errors[1] == ""
        assert not follower.done()
    finally:
        follower.cancel()
        await queue.aclose()


async def test_a_stranger_without_the_valkey_password_can_neither_announce_nor_report():
    server = start_embedded_valkey(password="s3cret-pass")
    try:
        announcer = UpdateAnnouncer(connect(server.connection_url), prefix="test:stranger")
        announcer.announce_key, announcer.report_key = "test:stranger:1:updates", "test:stranger:1:reports"
        with pytest.raises((AuthenticationError, NoPermissionError, ResponseError)):
            await announcer.announce(rollout_pb2.UpdateWeightsRequest(version=1))
        with pytest.raises((AuthenticationError, NoPermissionError, ResponseError)):
            await announcer.collect(1, 1, {"g"}, timeout_s=0.2)
        wrong = connect(server.connection_url, username=EMBEDDED_USER, password="guess")
        with pytest.raises((AuthenticationError, ResponseError)):
            await wrong.xadd("test:stranger:1:reports", {REPORT_FIELD: b"x"})
        member = connect(server.connection_url, username=EMBEDDED_USER, password="s3cret-pass")
        announcer.client = member
        await announcer.announce(rollout_pb2.UpdateWeightsRequest(version=1))  # the run's own user may
        assert await member.xlen("test:stranger:1:updates") == 1
    finally:
        server.stop()


async def test_with_valkey_unreachable_the_group_falls_back_to_one_call_per_server(valkey_url):
    from rlmesh.services.ports import free_port

    engine = Engine()
    server, service, _, broadcaster = await _plane(valkey_url, engine)
    broadcaster.announcer = UpdateAnnouncer(connect(f"redis://127.0.0.1:{free_port()}"))  # nothing listens there
    try:
        await broadcaster.broadcast(1, WeightSource.of(_named(1)))
        assert not broadcaster.announced and service.num_update_calls == 1
        assert broadcaster.verified_versions == [1] and engine.version == 1
    finally:
        await server.stop(0)
