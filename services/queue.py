"""Redis Streams work queues with consumer groups: the prompt stream and the trajectory stream.

Delivery contract: a producer publishes protobuf bytes under a key (the group id); a key is
published at most once per stream, so a retried or re-generated group is dropped here. Consumers
read as named members of one consumer group, ack after the work is durable, and claim entries
left pending by a dead consumer after an idle timeout. Acked entries are deleted, so the stream
length is exactly the unacked backlog; a producer that would push it past `max_len` waits
(backpressure) instead of trimming anything unread."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

log = logging.getLogger(__name__)

# Atomic: drop a key seen before, refuse when full, else remember the key and append.
_PUBLISH_LUA = """
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then return 0 end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[3]) then return -1 end
redis.call('SADD', KEYS[2], ARGV[1])
return redis.call('XADD', KEYS[1], '*', 'key', ARGV[1], 'data', ARGV[2])
"""


class QueueFullError(TimeoutError):
    """The stream stayed at `max_len` unacked entries past the producer's wait timeout."""


@dataclass(frozen=True)
class Entry:
    id: str
    key: str
    data: bytes


@dataclass(frozen=True)
class QueueDepth:
    length: int
    """Unacked entries (delivered or not)."""
    pending: int
    """Delivered to a consumer, not yet acked."""
    lag: int
    """Not yet delivered to any consumer."""


def connect(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, decode_responses=False, socket_connect_timeout=5, health_check_interval=30)


class StreamQueue:
    """One stream + one consumer group."""

    def __init__(
        self,
        client: aioredis.Redis,
        stream: str,
        *,
        group: str = "workers",
        max_len: int = 10000,
        claim_idle_ms: int = 60000,
    ) -> None:
        self.client, self.stream, self.group = client, stream, group
        self.max_len, self.claim_idle_ms = max_len, claim_idle_ms
        self._seen_key = f"{stream}:published"
        self._publish = client.register_script(_PUBLISH_LUA)

    async def ensure_group(self) -> None:
        try:
            await self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def publish(self, key: str, data: bytes, *, wait_timeout_s: float | None = None) -> str | None:
        """Append unless `key` was published before (then None). Waits while the stream is full;
        raises QueueFullError after `wait_timeout_s` (None: wait forever)."""
        start, delay, warned = time.monotonic(), 0.01, False
        while True:
            result = await self._publish(keys=[self.stream, self._seen_key], args=[key, data, self.max_len])
            if result == 0:
                return None
            if result != -1:
                return result.decode() if isinstance(result, bytes) else str(result)
            waited = time.monotonic() - start
            if wait_timeout_s is not None and waited >= wait_timeout_s:
                raise QueueFullError(
                    f"stream {self.stream!r} held {self.max_len} unacked entries for {waited:.0f}s; "
                    "consumers are not keeping up (raise queue.max_len or add consumers)"
                )
            if not warned and waited > 5:
                log.warning("stream %s is full (%d unacked): producer waiting", self.stream, self.max_len)
                warned = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def read(self, consumer: str, *, count: int = 16, block_ms: int | None = 1000) -> list[Entry]:
        """New entries for `consumer` (they stay pending on it until acked)."""
        reply = await self.client.xreadgroup(self.group, consumer, {self.stream: ">"}, count=count, block=block_ms)
        return _entries(reply[0][1]) if reply else []

    async def read_own_pending(self, consumer: str, *, count: int = 1000) -> list[Entry]:
        """Entries delivered to `consumer` earlier and never acked (replay after a restart)."""
        reply = await self.client.xreadgroup(self.group, consumer, {self.stream: "0"}, count=count)
        return _entries(reply[0][1]) if reply else []

    async def claim_stale(self, consumer: str, *, count: int = 16) -> list[Entry]:
        """Take over entries pending on any consumer for longer than `claim_idle_ms`."""
        _, claimed, *_ = await self.client.xautoclaim(
            self.stream, self.group, consumer, min_idle_time=self.claim_idle_ms, start_id="0-0", count=count
        )
        return _entries(claimed)

    async def ack(self, *entry_ids: str) -> int:
        """Ack and delete; returns how many were still pending (0 for an already-acked id)."""
        if not entry_ids:
            return 0
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.xdel(self.stream, *entry_ids)
            acked, _ = await pipe.execute()
        return int(acked)

    async def depth(self) -> QueueDepth:
        length = await self.client.xlen(self.stream)
        pending = lag = 0
        try:
            for info in await self.client.xinfo_groups(self.stream):
                if info["name"].decode() == self.group:
                    pending = int(info["pending"])
                    lag = int(info.get("lag") or 0)
        except ResponseError:
            pass  # stream not created yet
        return QueueDepth(length=length, pending=pending, lag=lag)


def _entries(raw: list) -> list[Entry]:
    out = []
    for entry_id, fields in raw:
        if not fields:  # deleted while pending
            continue
        out.append(Entry(id=entry_id.decode(), key=fields[b"key"].decode(), data=fields[b"data"]))
    return out
