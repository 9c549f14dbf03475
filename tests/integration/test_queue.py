"""Redis-stream queues against a real Valkey server."""

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from rlmesh.services.queue import QueueFullError, QueueUnavailable, StreamQueue, connect

pytestmark = pytest.mark.integration

HOLDER = """
import asyncio, sys
from rlmesh.services.queue import StreamQueue, connect
async def main(url, stream, count):
    q = StreamQueue(connect(url), stream, max_len=100000, claim_idle_ms=300)
    held = await q.read("doomed", count=int(count), block_ms=5000)
    print(len(held), flush=True)
    await asyncio.sleep(3600)  # holds the entries, never acks: killed by the test
asyncio.run(main(*sys.argv[1:]))
"""


def _queue(url, stream, **kw):
    return StreamQueue(connect(url), stream, **kw)


async def test_entries_of_a_killed_consumer_are_claimed_and_acked_exactly_once(valkey_url):
    stream = f"test:{uuid.uuid4().hex}"
    q = _queue(valkey_url, stream, max_len=100000, claim_idle_ms=300)
    await q.ensure_group()
    keys = [f"group-{i}" for i in range(200)]
    for k in keys:
        assert await q.publish(k, k.encode()) is not None

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, valkey_url, stream, "120"], stdout=subprocess.PIPE,
                              text=True, cwd=os.getcwd())
    assert holder.stdout.readline().strip() == "120"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (await q.depth()).pending == 120

    acked_keys: list[str] = []
    acks = 0
    deadline = time.monotonic() + 30
    while len(acked_keys) < len(keys) and time.monotonic() < deadline:
        entries = await q.claim_stale("survivor", count=50) or await q.read("survivor", count=50, block_ms=200)
        for e in entries:
            acked_keys.append(e.key)
            acks += await q.ack(e.id)
    assert sorted(acked_keys) == sorted(keys), "every published group id is processed"
    assert acks == len(keys), "each one acked exactly once"
    assert len(set(acked_keys)) == len(acked_keys)
    depth = await q.depth()
    assert (depth.length, depth.pending, depth.lag) == (0, 0, 0)


async def test_publish_is_idempotent_by_key(valkey_url):
    q = _queue(valkey_url, f"test:{uuid.uuid4().hex}")
    await q.ensure_group()
    assert await q.publish("g1", b"a") is not None
    assert await q.publish("g1", b"a") is None
    entries = await q.read("c", count=10, block_ms=100)
    assert [e.key for e in entries] == ["g1"]


async def test_full_stream_applies_backpressure_and_trims_nothing(valkey_url):
    q = _queue(valkey_url, f"test:{uuid.uuid4().hex}", max_len=3)
    await q.ensure_group()
    for i in range(3):
        await q.publish(f"k{i}", b"x")
    with pytest.raises(QueueFullError, match="max_len"):
        await q.publish("k3", b"x", wait_timeout_s=0.3)
    # A waiting producer goes through as soon as a consumer acks.
    waiter = asyncio.create_task(q.publish("k3", b"x", wait_timeout_s=10))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    entry = (await q.read("c", count=1, block_ms=100))[0]
    await q.ack(entry.id)
    assert await asyncio.wait_for(waiter, 5) is not None
    remaining = await q.read("c", count=10, block_ms=100)
    assert [e.key for e in remaining] == ["k1", "k2", "k3"], "unread entries were never trimmed"


async def test_publish_many_is_one_round_trip_with_publishs_guarantees(valkey_url):
    q = _queue(valkey_url, f"test:{uuid.uuid4().hex}", max_len=4)
    await q.ensure_group()
    assert await q.publish("k0", b"0") is not None
    # k0 again is dropped by key; k4 finds the stream full (4) and waits until a consumer acks.
    items = [(f"k{i}", str(i).encode()) for i in (0, 1, 2, 3, 4)]
    publishing = asyncio.create_task(q.publish_many(items, wait_timeout_s=10))
    await asyncio.sleep(0.3)
    assert not publishing.done()
    first = (await q.read("c", count=1, block_ms=100))[0]
    await q.ack(first.id)
    assert await asyncio.wait_for(publishing, 5) == 4
    rest = await q.read("c", count=10, block_ms=100)
    assert [(e.key, e.data) for e in [first, *rest]] == [(f"k{i}", str(i).encode()) for i in range(5)]
    assert await q.publish_many([("k2", b"2")]) == 0 and await q.publish_many([]) == 0


async def test_restarted_consumer_replays_its_own_pending(valkey_url):
    q = _queue(valkey_url, f"test:{uuid.uuid4().hex}")
    await q.ensure_group()
    await q.publish("a", b"1")
    await q.read("learner", count=1, block_ms=100)
    replay = await q.read_own_pending("learner")
    assert [e.key for e in replay] == ["a"]


async def test_dead_letter_moves_the_entry_with_its_reason_and_acks_it(valkey_url):
    q = _queue(valkey_url, f"test:{uuid.uuid4().hex}")
    await q.ensure_group()
    await q.publish("bad", b"not a PromptGroup")
    entry = (await q.read("c", count=1, block_ms=100))[0]
    await q.dead_letter(entry, "undecodable PromptGroup", by="rollout-0")
    assert (await q.depth()).length == 0
    [(entry_id, fields)] = await q.client.xrange(f"{q.stream}:dead")
    assert fields == {b"key": b"bad", b"data": b"not a PromptGroup", b"reason": b"undecodable PromptGroup",
                      b"by": b"rollout-0"}
    assert await q.read_dead_letters("0-0") == [
        (entry_id.decode(), {"key": "bad", "reason": "undecodable PromptGroup", "by": "rollout-0"})]
    assert await q.read_dead_letters(entry_id.decode()) == []


async def test_refreshed_claims_are_not_taken_by_another_consumer(valkey_url):
    q = _queue(valkey_url, f"test:{uuid.uuid4().hex}", claim_idle_ms=300)
    await q.ensure_group()
    for key in ("kept", "stale"):
        await q.publish(key, b"x")
    held = await q.read("busy", count=2, block_ms=100)
    refresh = q.claim_refresher(valkey_url)
    for _ in range(4):  # the busy consumer keeps working on "kept" only
        await asyncio.sleep(0.15)
        await asyncio.to_thread(refresh, "busy", [e.id for e in held if e.key == "kept"])
    assert [e.key for e in await q.claim_stale("other")] == ["stale"]
    # Refreshing through a queue server that is gone is skipped, not raised (the event loop reports outages).
    _queue("redis://127.0.0.1:1", q.stream).claim_refresher("redis://127.0.0.1:1")("busy", ["0-1"])


async def test_the_claim_refresher_connects_as_the_queue_does():
    """The refresher takes the user and password of the queue's own client: on a queue server that
    wants a password, a refresher without it would fail (quietly) and let the claims lapse."""
    from rlmesh.services.valkey import start_embedded_valkey

    server = start_embedded_valkey()
    try:
        password = "pw-" + uuid.uuid4().hex
        admin = connect(server.connection_url)
        await admin.execute_command("ACL", "SETUSER", "default", "resetpass", f">{password}")
        url = server.connection_url.replace("redis://", f"redis://default:{password}@")
        q = _queue(url, f"test:{uuid.uuid4().hex}", claim_idle_ms=300)
        await q.ensure_group()
        await q.publish("kept", b"x")
        held = await q.read("busy", count=1, block_ms=100)
        refresh = q.claim_refresher(server.connection_url)  # the URL without the password
        for _ in range(4):
            await asyncio.sleep(0.15)
            await asyncio.to_thread(refresh, "busy", [e.id for e in held])
        assert await q.claim_stale("other") == []
    finally:
        server.stop()


async def test_an_unreachable_queue_server_is_reported_naming_the_stream(valkey_url):
    q = _queue("redis://127.0.0.1:1", "test:nowhere", reconnect_timeout_s=0.5)
    with pytest.raises(QueueUnavailable, match=r"publish on stream 'test:nowhere': queue server unreachable for [0-9]+s"):
        await q.publish("k", b"x")
    assert not q.connected and "ConnectionError" in q.last_error
