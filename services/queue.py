"""Redis Streams work queues with consumer groups: the prompt stream and the trajectory stream.

Delivery contract: a producer publishes protobuf bytes under a key (the group id); a key is
published at most once per stream, so a retried or re-generated group is dropped here. Consumers
read as named members of one consumer group, ack after the work is durable, and claim entries
left pending by a dead consumer after an idle timeout. Acked entries are deleted, so the stream
length is exactly the unacked backlog; a producer that would push it past `max_len` waits
(backpressure) instead of trimming anything unread.

Outages: every call retries lost connections with exponential backoff (logged; `connected` and
`last_error` say so for health checks) for up to `reconnect_timeout_s`, then raises
`QueueUnavailable` naming the stream. Every call is safe to retry: publishing is idempotent by key,
acks by id. A consumer group that vanished (a queue server restarted without its data) is
re-created on the spot and counted in `num_group_recreations`, so the owner can notice the loss."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlmesh.services.auth import read_secret
from rlmesh.services.config import REDACTED, QueueSection, default, redact_url
from rlmesh.services.retry import Backoff, describe_error, retry

if TYPE_CHECKING:
    from rlmesh.services.config import QueueSection

log = logging.getLogger(__name__)

# Atomic, for each (key, data) pair of ARGV after the first (max_len): drop a key seen before (0),
# refuse when the stream is full (-1), else remember the key and append (the entry id). One script a
# batch (a single publish is a batch of one): Valkey passes over every client blocked on the stream
# after each command, which at a thousand idle rollout servers made each prompt group of a pipelined
# batch cost it ~1 ms (O(servers x groups) a step).
_PUBLISH_MANY_LUA = """
local out = {}
for i = 2, #ARGV, 2 do
  if redis.call('SISMEMBER', KEYS[2], ARGV[i]) == 1 then out[#out + 1] = 0
  elseif redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then out[#out + 1] = -1
  else
    redis.call('SADD', KEYS[2], ARGV[i])
    out[#out + 1] = redis.call('XADD', KEYS[1], '*', 'key', ARGV[i], 'data', ARGV[i + 1])
  end
end
return out
"""


T = TypeVar("T")
_LOST = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
_RECONNECT = Backoff(0.1, 2.0)
_FULL_WAIT = Backoff(0.01, 0.5)  # a producer polling a full stream

PROMPT_GROUP = "rollout"
"""The consumer group reading the prompt stream: the rollout servers."""
TRAJECTORY_GROUP = "learner"
"""The consumer group reading the trajectory stream: the learner."""


class QueueUnavailable(ConnectionError):
    """The queue server stayed unreachable past `reconnect_timeout_s`."""


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


def check_url(url: str) -> None:
    """Raise ValueError, saying what to give instead, unless `url` is one a service can dial (run
    before a tier loads anything heavy: `rlmesh rollout` and `rlmesh learner` check it first)."""
    if url == "embedded":
        raise ValueError("queue.url is 'embedded': only `rlmesh up` starts an embedded queue server; a service run "
                         "on its own needs queue.url=redis://HOST:PORT of a running Valkey/Redis")
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"queue.url={redact_url(url)!r} is not a redis:// (or rediss://, unix://) URL")
    if urlsplit(url).password == REDACTED:
        raise ValueError("queue.url holds a redacted password ('***'); give the password with queue.password_file "
                         "or the variable named by queue.password_env")


def connect(url: str, *, username: str | None = None, password: str | None = None,
            ssl: dict[str, str] | None = None) -> aioredis.Redis:
    """A client for `url`; `ssl` holds redis-py's ssl_* file options for a rediss:// URL."""
    check_url(url)
    extra = dict(ssl or {}) if url.startswith("rediss://") else {}
    return aioredis.Redis.from_url(url, decode_responses=False, socket_connect_timeout=5, health_check_interval=30,
                                   username=username, password=password, **extra)


def queue_password(section: QueueSection, tier: str) -> str | None:
    """The queue password from queue.password_file (`{tier}` filled in), else queue.password_env."""
    path = str(Path(section.password_file.replace("{tier}", tier))) if section.password_file else None
    return read_secret("queue.password_file", path, section.password_env)


def connect_queue(section: QueueSection, tier: str) -> aioredis.Redis:
    """A client for the run's queue as `tier` (learner or rollout): its ACL user and password, and
    TLS files for a rediss:// URL, all from the queue section."""
    files = {"ssl_ca_certs": section.tls_ca_file, "ssl_certfile": section.tls_cert_file,
             "ssl_keyfile": section.tls_key_file}
    ssl = {k: v.replace("{tier}", tier) for k, v in files.items() if v}
    username = section.username.replace("{tier}", tier) if section.username else None
    return connect(section.url, username=username, password=queue_password(section, tier), ssl=ssl)


def run_streams(client: aioredis.Redis, cfg: QueueSection) -> tuple[StreamQueue, StreamQueue]:
    """The run's prompt stream (read by the rollout servers) and trajectory stream (read by the learner)."""
    prompts = StreamQueue(client, cfg.prompt_stream, group=PROMPT_GROUP, max_len=cfg.max_len,
                          claim_idle_ms=cfg.claim_idle_ms)
    trajectories = StreamQueue(client, cfg.trajectory_stream, group=TRAJECTORY_GROUP, max_len=cfg.max_len,
                               claim_idle_ms=cfg.claim_idle_ms)
    return prompts, trajectories


class StreamQueue:
    """One stream + one consumer group."""

    def __init__(
        self,
        client: aioredis.Redis,
        stream: str,
        *,
        group: str = "workers",
        max_len: int = default(QueueSection, "max_len"),
        claim_idle_ms: int = default(QueueSection, "claim_idle_ms"),
        reconnect_timeout_s: float = 300.0,
    ) -> None:
        self.client, self.stream, self.group = client, stream, group
        self.max_len, self.claim_idle_ms = max_len, claim_idle_ms
        self.reconnect_timeout_s = reconnect_timeout_s
        self._seen_key = f"{stream}:published"
        self._publish_many = client.register_script(_PUBLISH_MANY_LUA)
        self.connected = True
        self.last_error = ""
        self.num_reconnects = 0
        self.num_group_recreations = 0

    async def _call(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run `op`, riding out connection loss (backoff, logged) and re-creating a vanished group."""

        async def attempt() -> T:
            try:
                return await op()
            except ResponseError as err:
                if "NOGROUP" not in str(err):
                    raise
                self.num_group_recreations += 1
                log.error("consumer group %s of stream %s is gone (queue server restarted without its data?); "
                          "re-creating it", self.group, self.stream)
                await self._create_group()
                return await op()

        def lost(err: BaseException) -> None:
            self.connected = False
            self.last_error = describe_error(err)

        def unavailable(err: BaseException, elapsed_s: float) -> QueueUnavailable:
            return QueueUnavailable(
                f"{what} on stream {self.stream!r}: queue server unreachable for {elapsed_s:.0f}s "
                f"({self.last_error}); check that it is running and that queue.url points at it")

        result = await retry(attempt, what=f"queue server unreachable during {what} on {self.stream}",
                             retry_on=_LOST, backoff=_RECONNECT, deadline_s=self.reconnect_timeout_s,
                             give_up=unavailable, on_failure=lost, log=log, log_every_s=5.0)
        if not self.connected:
            self.connected = True
            self.num_reconnects += 1
            log.warning("queue server reachable again (%s on %s)", what, self.stream)
        return result

    async def _create_group(self) -> None:
        try:
            await self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def ensure_group(self) -> None:
        await self._call("create group", self._create_group)

    async def publish(self, key: str, data: bytes, *, wait_timeout_s: float | None = None) -> str | None:
        """Append unless `key` was published before (then None). Waits while the stream is full;
        raises QueueFullError after `wait_timeout_s` (None: wait forever)."""
        start, warned, attempt = time.monotonic(), False, 0
        while True:
            [result] = await self._call("publish", lambda: self._publish_many(keys=[self.stream, self._seen_key],
                                                                             args=[self.max_len, key, data]))
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
            await asyncio.sleep(_FULL_WAIT.delay(attempt))
            attempt += 1

    async def publish_many(self, items: list[tuple[str, bytes]], *, wait_timeout_s: float | None = None) -> int:
        """`publish` for each (key, data), in one script call on the queue server; those the stream had
        no room for are then published one by one, waiting as `publish` does. Returns how many were
        appended (a key published before is dropped, as by `publish`)."""
        if not items:
            return 0
        args: list = [self.max_len]
        for key, data in items:
            args += (key, data)
        results = await self._call("publish", lambda: self._publish_many(keys=[self.stream, self._seen_key], args=args))
        appended = sum(1 for r in results if r not in (0, -1))
        for (key, data), result in zip(items, results):
            if result == -1 and await self.publish(key, data, wait_timeout_s=wait_timeout_s) is not None:
                appended += 1
        return appended

    async def read(self, consumer: str, *, count: int = 16, block_ms: int | None = 1000) -> list[Entry]:
        """New entries for `consumer` (they stay pending on it until acked)."""
        reply = await self._call("read", lambda: self.client.xreadgroup(
            self.group, consumer, {self.stream: ">"}, count=count, block=block_ms))
        return _entries(reply[0][1]) if reply else []

    async def read_own_pending(self, consumer: str, *, count: int = 1000) -> list[Entry]:
        """Entries delivered to `consumer` earlier and never acked (replay after a restart)."""
        reply = await self._call("replay", lambda: self.client.xreadgroup(
            self.group, consumer, {self.stream: "0"}, count=count))
        return _entries(reply[0][1]) if reply else []

    async def claim_stale(self, consumer: str, *, count: int = 16) -> list[Entry]:
        """Take over entries pending on any consumer for longer than `claim_idle_ms`."""
        _, claimed, *_ = await self._call("claim", lambda: self.client.xautoclaim(
            self.stream, self.group, consumer, min_idle_time=self.claim_idle_ms, start_id="0-0", count=count))
        return _entries(claimed)

    async def ack(self, *entry_ids: str) -> int:
        """Ack and delete; returns how many were still pending (0 for an already-acked id)."""
        if not entry_ids:
            return 0

        async def op() -> int:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.xack(self.stream, self.group, *entry_ids)
                pipe.xdel(self.stream, *entry_ids)
                acked, _ = await pipe.execute()
            return int(acked)

        return await self._call("ack", op)

    async def dead_letter(self, entry: Entry, reason: str, by: str = "") -> None:
        """Move `entry` to the stream's dead-letter stream (`<stream>:dead`) with `reason` and the
        consumer that rejected it (`by`), and ack it."""
        await self._call("dead-letter", lambda: self.client.xadd(
            f"{self.stream}:dead", {"key": entry.key, "data": entry.data, "reason": reason[:2000], "by": by[:200]}))
        await self.ack(entry.id)

    async def read_dead_letters(self, after: str, count: int = 256) -> list[tuple[str, dict[str, str]]]:
        """Entries of the dead-letter stream after id `after` ("0-0": all), without their data:
        (id, {key, reason, by})."""
        reply = await self._call("read dead letters", lambda: self.client.xread(
            {f"{self.stream}:dead": after}, count=count))
        out = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                out.append((entry_id.decode(), {k.decode(): fields[k].decode(errors="replace")
                                                for k in (b"key", b"reason", b"by") if k in fields}))
        return out

    def claim_refresher(self, url: str, **options: Any) -> Callable[[str, list[str]], None]:
        """A blocking `refresh(consumer, entry_ids)` that resets the idle time of entries pending on
        `consumer`, so that `claim_stale` elsewhere does not take work still being done. It has a
        connection of its own to `url` (`options`: redis-py's, e.g. username, password, ssl_*), for
        a thread of its own: an event loop busy with a large batch must not let claims lapse. A
        failure is logged at debug and skipped (the next refresh tries again; the event loop's own
        calls report the outage)."""
        import redis

        # The same credentials as this queue's own client (a password-protected queue refuses others).
        own = self.client.connection_pool.connection_kwargs
        options = {k: own[k] for k in ("username", "password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
                   if own.get(k)} | options
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5, **options)

        def refresh(consumer: str, entry_ids: list[str]) -> None:
            try:
                client.xclaim(self.stream, self.group, consumer, 0, entry_ids, justid=True)
            except redis.RedisError as err:
                log.debug("claim refresh on %s failed: %s", self.stream, err)

        return refresh

    async def depth(self) -> QueueDepth:
        async def op() -> QueueDepth:
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

        return await self._call("depth", op)

    async def get_marker(self, name: str) -> bytes | None:
        return await self._call("get marker", lambda: self.client.get(f"{self.stream}:{name}"))

    async def set_marker(self, name: str, value: str) -> None:
        await self._call("set marker", lambda: self.client.set(f"{self.stream}:{name}", value))


def _entries(raw: list) -> list[Entry]:
    out = []
    for entry_id, fields in raw:
        if not fields:  # deleted while pending
            continue
        out.append(Entry(id=entry_id.decode(), key=fields[b"key"].decode(), data=fields[b"data"]))
    return out
