"""Trajectory admission: which arriving groups go into the training buffer. Everything refused is
acked, counted and written to `dropped_groups.jsonl` with its reason; nothing refused is trained on.
A group must first be one this run issued and well formed (`rlmesh.learner.validation`): a forged
or malformed entry in the trajectory stream is dropped and the run goes on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from rlmesh.learner.validation import Bounds, problems
from rlmesh.v1 import common_pb2
from rlmesh.services.queue import Entry, StreamQueue

log = logging.getLogger(__name__)


class RecordWriter(Protocol):
    def write(self, record: dict) -> None: ...


def staleness(group: common_pb2.TrajectoryGroup, version: int) -> int:
    """Learner version minus the oldest version that produced any token of the group."""
    return version - min((s.min_version for s in group.samples), default=version)


class Admission:
    def __init__(self, trajectories: StreamQueue, dropped_log: RecordWriter, *, max_staleness: int,
                 drop_zero_advantage_groups: bool, on_returned: Callable[[str], None],
                 issued: Callable[[common_pb2.TrajectoryGroup], common_pb2.PromptGroup | None],
                 bounds: Bounds) -> None:
        """`issued` gives the prompt group this run issued under a group's id (None: not ours, or
        already back); `on_returned` tells the issuer such a group is back."""
        self.trajectories, self.dropped_log = trajectories, dropped_log
        self.k, self.drop_flat = max_staleness, drop_zero_advantage_groups
        self.on_returned, self.issued, self.bounds = on_returned, issued, bounds
        self.trained_groups: set[str] = set()
        # Admitted into the buffer and not trained yet: a second copy (a re-issued group whose
        # first copy also arrived) is a duplicate, never a second training sample.
        self.buffered: set[str] = set()
        self.num_dropped_stale = 0
        self.num_dropped_other = 0
        self.num_duplicates = 0
        self.num_dropped_invalid = 0  # not issued by this run, or malformed

    async def _drop(self, entry: Entry, group: common_pb2.TrajectoryGroup, version: int, reason: str) -> None:
        log.debug("group %s dropped: %s", group.group_id, reason)
        self.dropped_log.write({"version": version, "group_id": group.group_id, "reason": reason})
        await self.trajectories.ack(entry.id)

    async def drop_if_stale(self, entry: Entry, group: common_pb2.TrajectoryGroup, version: int) -> bool:
        age = staleness(group, version)
        if age <= self.k:
            return False
        self.num_dropped_stale += 1
        log.info("group %s dropped: staleness %d > max_staleness %d", group.group_id, age, self.k)
        await self._drop(entry, group, version, f"staleness {age} > max_staleness {self.k}")
        return True

    def check(self, group: common_pb2.TrajectoryGroup, version: int) -> str:
        """Why `group` (train or eval) is not this run's well-formed work, or "". A refused group is
        counted and written to the dropped log here; the caller acks it."""
        issued = self.issued(group)
        if issued is None:
            reason = "not issued by this run (unknown group id, or a copy of a group already back)"
        elif group.prompt.split == "train" and max((s.max_version for s in group.samples), default=0) > version:
            return ""  # a legitimate leftover of a learner restart: `accept` drops it with its own reason
        else:
            reason = problems(group, issued, version, self.bounds)
        if reason:
            self.num_dropped_invalid += 1
            log.warning("group %r from %r dropped: %s", group.group_id[:200], group.generator_id[:200], reason)
            self.dropped_log.write({"version": version, "group_id": group.group_id[:200], "invalid": True,
                                    "generator_id": group.generator_id[:200], "reason": reason})
        return reason

    async def accept(self, entry: Entry, group: common_pb2.TrajectoryGroup, version: int) -> bool:
        """True if a newly arrived train group goes into the training buffer."""
        if group.group_id in self.trained_groups or group.group_id in self.buffered:
            self.num_duplicates += 1
            await self.trajectories.ack(entry.id)
            return False
        ours = self.issued(group) is not None
        if self.check(group, version):
            if ours:  # back, malformed; a group id this run did not issue changes no count
                self.on_returned(group.group_id)
            await self.trajectories.ack(entry.id)
            return False
        self.on_returned(group.group_id)
        if await self.drop_if_stale(entry, group, version):
            return False
        reason = ""
        valid = [s for s in group.samples if not s.error]
        if max((max(s.min_version, s.max_version) for s in group.samples), default=0) > version:
            reason = "generated by weights newer than the learner's (lost in a learner restart)"
        elif len(valid) < 2:
            errors = {s.error for s in group.samples if s.error}
            reason = f"{len(valid)} valid samples (errors: {'; '.join(sorted(errors))[:300]})"
        elif self.drop_flat and len({s.reward for s in valid}) == 1:
            reason = "all rewards equal (dynamic sampling)"
        if reason:
            self.num_dropped_other += 1
            await self._drop(entry, group, version, reason)
            return False
        self.buffered.add(group.group_id)
        return True

    async def drop_undecodable(self, entry: Entry, err: Exception) -> None:
        """A trajectory-stream entry that is not a TrajectoryGroup: acked and counted, never trained."""
        log.error("trajectory entry %s is not a TrajectoryGroup (%s); dropped", entry.id, err)
        self.num_dropped_invalid += 1
        self.dropped_log.write({"entry_id": entry.id, "group_id": entry.key[:200], "invalid": True,
                                "reason": f"not a TrajectoryGroup ({err})"})
        await self.trajectories.ack(entry.id)

    def trained(self, group_id: str) -> None:
        self.buffered.discard(group_id)
        self.trained_groups.add(group_id)
