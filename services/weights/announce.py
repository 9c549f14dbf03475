"""Announced weight updates: the learner writes each update ONCE, as an entry of a Valkey stream that
every rollout server of a large group follows, instead of one UpdateWeights call per server (a
thousand unary calls from the learner's event loop cost it ~0.4 s a step; one XADD costs the same at
any size). Each server runs its usual single-call update path on the entry and answers with an
UpdateWeightsReport on a second stream, which the learner reads in batches beside the next step.

Both streams live on the run's Valkey, so a stranger needs its ACL user and password (and TLS
where configured) to touch them; their keys are random per learner and group epoch, so a stale
server of an earlier group reads nothing of the current one. Valkey access is not enough either:
each announcement is signed with a per-group Ed25519 key whose public half reached the servers in
InitWeightTransfer (the gRPC call that, under mutual TLS, only the learner may make), and each
report carries an HMAC under a key sent to that server alone, so no server can move another's
weights or report in its name. Entries are size-checked before anything else; an unsigned, forged,
malformed or oversized entry, a report from a server not in the group or for another update, is
ignored (and logged): a server that never reports is dropped at the deadline, as one whose call failed.

`UpdateAnnouncer` is the learner's side; `follow_updates` the rollout server's (`answer`: its reply to one entry)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlmesh.v1 import rollout_pb2

if TYPE_CHECKING:
    import redis.asyncio as aioredis

log = logging.getLogger(__name__)

UPDATE_FIELD, SIGNATURE_FIELD = b"u", b"s"
REPORT_FIELD, MAC_FIELD = b"r", b"m"
MAX_UPDATE_BYTES = 32 * 2**20
"""Largest announced update a server parses (as rollout.max_message_mib's default: tensor names and shapes)."""
MAX_REPORT_BYTES = 64 * 2**10
"""Largest report the learner parses (a few digests and numbers; anything larger is not a report)."""
KEY_TTL_S = 24 * 3600
"""The streams of a group outlive the learner that made them by at most this long."""
BLOCK_MS = 2500
"""Longest blocking read of either stream: half the queue client's socket timeout (redis-py takes it from
socket_connect_timeout, 5 s in `services.queue.connect`). A read blocked as long as the timeout fails
with TimeoutError whenever nothing is announced for that long, which a follower took for Valkey being
away (a warning, a second's sleep, the next announcement up to a second late): every server, every
quiet five seconds."""
REPORTS_PER_READ = 1000
"""Reports the learner reads and checks at a time: ten thousand in one reply held its event loop for
0.75 s (parsing, decoding, two HMACs each), heartbeats and admission waiting behind it."""
LOST = (RedisConnectionError, RedisTimeoutError, OSError)


class UpdateAnnouncer:
    """The learner's side: one stream pair per group epoch, an entry per update, reports read in batches."""

    def __init__(self, client: aioredis.Redis, prefix: str = "rlmesh:weights") -> None:
        self.client = client
        self.prefix = f"{prefix}:{secrets.token_hex(8)}"  # fresh per learner: a restarted one shares no keys
        self.announce_key = self.report_key = ""
        self._last_report = "0-0"
        self._open: set[int] = set()  # versions announced to this group whose reports are not collected yet
        self._ahead: dict[int, dict[str, rollout_pb2.UpdateWeightsResponse | Exception]] = {}
        """Reports of a later open version read while collecting an earlier one (updates overlap: one
        reader, one cursor), taken by that version's collect."""
        self._signing = Ed25519PrivateKey.generate()
        self._report_secret = secrets.token_bytes(32)

    @property
    def public_key(self) -> bytes:
        """What followers check this group's announcements with (InitWeightTransferRequest.announce_public_key)."""
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        return self._signing.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def report_key_for(self, generator_id: str) -> bytes:
        """The key `generator_id` signs its reports with (sent to it alone, in InitWeightTransferRequest.report_key)."""
        return hmac.new(self._report_secret, generator_id.encode(), hashlib.sha256).digest()

    async def open(self, epoch: int) -> tuple[str, str]:
        """The streams of group `epoch` (the previous group's are deleted): (announce, report) keys."""
        if self.announce_key:
            await self.client.delete(self.announce_key, self.report_key)
        self.announce_key, self.report_key = f"{self.prefix}:{epoch}:updates", f"{self.prefix}:{epoch}:reports"
        self._last_report = "0-0"
        self._open, self._ahead = set(), {}
        self._signing, self._report_secret = Ed25519PrivateKey.generate(), secrets.token_bytes(32)  # fresh per group
        return self.announce_key, self.report_key

    async def announce(self, request: rollout_pb2.UpdateWeightsRequest) -> None:
        """Every follower of the current group starts `request` (one entry, whatever the group's size)."""
        data = request.SerializeToString()
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(self.announce_key, {UPDATE_FIELD: data, SIGNATURE_FIELD: self._signing.sign(data)}, maxlen=8,
                  approximate=False)
        pipe.expire(self.announce_key, KEY_TTL_S)
        pipe.expire(self.report_key, KEY_TTL_S)  # made by the first reports: from the second update on
        # Open before the entry is out: a quick server's report may be read (by the collect of the update
        # before) before this call returns.
        self._open.add(request.version)
        try:
            await pipe.execute()
        except BaseException:
            self._open.discard(request.version)
            raise

    async def collect(self, version: int, epoch: int, member_ids: set[str], timeout_s: float,
                      waiting: set[str] | None = None) -> dict[str, rollout_pb2.UpdateWeightsResponse | Exception]:
        """Every member's reply to update `version`, or the error it reported, or a TimeoutError for
        one that did not report within `timeout_s`. Collects of one group run one at a time, in the
        order of their versions: reports of a later announced version read meanwhile are kept for it.
        `waiting` (default: every member) may shrink while this runs: a member taken out of it (dropped
        by an earlier update) is no longer waited for, and has no entry in the result."""
        waiting = member_ids if waiting is None else waiting
        out = {gid: got for gid, got in self._ahead.pop(version, {}).items() if gid in member_ids}
        deadline = time.monotonic() + timeout_s
        while waiting - out.keys() and (left_s := deadline - time.monotonic()) > 0:
            try:
                got = await self.client.xread({self.report_key: self._last_report}, count=REPORTS_PER_READ,
                                              block=max(1, int(min(left_s, BLOCK_MS / 1000) * 1000)))
            except LOST as err:  # read on from the last report once it is back, until the deadline
                log.warning("reading weight-update reports: Valkey unreachable (%r); retrying", err)
                await asyncio.sleep(min(0.5, max(left_s, 0.0)))
                continue
            for _, entries in got or []:
                for entry_id, fields in entries:
                    self._last_report = entry_id
                    self._take(fields, version, epoch, member_ids, out)
        self._open.discard(version)
        for gid in waiting - set(out):
            out[gid] = TimeoutError(f"no report of update v{version} within {timeout_s:g}s (weight_sync.timeout_s)")
        return out

    def _take(self, fields: dict, version: int, epoch: int, member_ids: set[str], out: dict) -> None:
        data = fields.get(REPORT_FIELD)
        if data is None or len(data) > MAX_REPORT_BYTES:
            log.warning("ignored a weight-update report without field r or over %d bytes on %s", MAX_REPORT_BYTES,
                        self.report_key)
            return
        try:
            report = rollout_pb2.UpdateWeightsReport.FromString(data)
        except DecodeError:
            log.warning("ignored a malformed weight-update report on %s", self.report_key)
            return
        if report.generator_id not in member_ids or report.group_epoch != epoch:
            log.warning("ignored a weight-update report from %r (epoch %d): not a member of group epoch %d",
                        report.generator_id[:64], report.group_epoch, epoch)
            return
        mac = hmac.new(self.report_key_for(report.generator_id), data, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, fields.get(MAC_FIELD) or b""):
            log.warning("ignored a weight-update report in the name of %s without its key", report.generator_id)
            return
        got = RuntimeError(report.error) if report.error else report.reply
        if report.version == version:
            out[report.generator_id] = got
        elif report.version > version and report.version in self._open:  # the next update's, early
            self._ahead.setdefault(report.version, {})[report.generator_id] = got
        # else a late report of an earlier update, already settled without it


async def follow_updates(client: aioredis.Redis, init: rollout_pb2.InitWeightTransferRequest,
                         apply: Callable[[rollout_pb2.UpdateWeightsRequest],
                                         Awaitable[rollout_pb2.UpdateWeightsResponse]],
                         block_ms: int = BLOCK_MS) -> None:
    """The rollout server's side, for the group `init` formed: run `apply` on every update announced on
    init.announce_stream, in order, and report each outcome on init.report_stream. Runs until cancelled
    (the next InitWeightTransfer replaces it)."""
    last = "0-0"
    public_key = Ed25519PublicKey.from_public_bytes(init.announce_public_key)
    while True:
        try:
            got = await client.xread({init.announce_stream: last}, count=1, block=block_ms)
        except LOST as err:
            log.warning("announced weight updates: Valkey unreachable (%r); retrying in 1 s", err)
            await asyncio.sleep(1.0)
            continue
        for _, entries in got or []:
            for entry_id, fields in entries:
                last = entry_id
                await answer(client, init, fields, apply, public_key)


async def answer(client: aioredis.Redis, init: rollout_pb2.InitWeightTransferRequest, fields: dict,
                 apply: Callable[[rollout_pb2.UpdateWeightsRequest], Awaitable[rollout_pb2.UpdateWeightsResponse]],
                 public_key: Ed25519PublicKey) -> None:
    """One announced entry, as the server of `init` takes it: `apply` it if the learner signed it, and
    report the outcome (its reply, or the error) on init.report_stream."""
    if not signed(fields, public_key):
        log.warning("ignored an entry of %s that the learner did not sign", init.announce_stream)
        return  # no report: a stranger gets nothing out of writing here
    report = rollout_pb2.UpdateWeightsReport(generator_id=init.generator_id, group_epoch=init.group_epoch)
    try:
        report.reply.CopyFrom(await apply(parse_update(fields, init.group_epoch, report)))
    except Exception as err:  # noqa: BLE001 - reported to the learner, which drops this server
        log.error("announced weight update v%d failed: %r", report.version, err)
        report.error = f"{type(err).__name__}: {err}"[:4096]
    data = report.SerializeToString()
    fields = {REPORT_FIELD: data, MAC_FIELD: hmac.new(init.report_key, data, hashlib.sha256).digest()}
    for attempt in range(10):  # a report lost with Valkey costs this server its place in the group
        try:
            await client.xadd(init.report_stream, fields, maxlen=1_000_000, approximate=True)
            return
        except LOST as err:
            log.warning("reporting weight update v%d: Valkey unreachable (%r); retrying", report.version, err)
            await asyncio.sleep(1.0)


def signed(fields: dict, public_key: Ed25519PublicKey) -> bool:
    """Whether the entry's update is within size and signed by the learner of this group."""
    data, signature = fields.get(UPDATE_FIELD), fields.get(SIGNATURE_FIELD)
    if data is None or signature is None or len(data) > MAX_UPDATE_BYTES:
        return False
    try:
        public_key.verify(signature, data)
    except InvalidSignature:
        return False
    return True


def parse_update(fields: dict, group_epoch: int, report: rollout_pb2.UpdateWeightsReport
                 ) -> rollout_pb2.UpdateWeightsRequest:
    """The announced request in `fields` (its version noted in `report`); ValueError if it is not one
    for this group."""
    try:
        request = rollout_pb2.UpdateWeightsRequest.FromString(fields[UPDATE_FIELD])
    except DecodeError as err:
        raise ValueError(f"malformed announced update: {err}") from err
    report.version = request.version
    if request.group_epoch != group_epoch:
        raise ValueError(f"announced update v{request.version} is for group epoch {request.group_epoch} (this "
                         f"server is in {group_epoch})")
    return request
