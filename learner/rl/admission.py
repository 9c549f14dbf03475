"""Trajectory admission: which arriving groups go into the training buffer. Everything refused is
acked, counted and written to `dropped_groups.jsonl` with its reason; nothing refused is trained on.
A group must first be one this run issued and well formed (`rlmesh.learner.rl.validation`): a forged
or malformed entry in the trajectory stream is dropped and the run goes on.

A malformed copy never costs the real group: every copy under an id this run issued is validated,
whatever became of the id, and a malformed one leaves the id outstanding, so that the rollout
server's well-formed copy, arriving before or after it, is trained once. A group whose copies stay
malformed is issued again under a fresh id once `overdue` says so (the learner's loop asks); the old
id is retired and a late copy of it is dropped, never trained beside the new one."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from rlmesh.learner.rl.validation import Bounds, problems
from rlmesh.v1 import common_pb2
from rlmesh.services.queue import Entry, StreamQueue

if TYPE_CHECKING:
    from rlmesh.learner.rl.ledger import Ledger
    from rlmesh.learner.rl.watch import StallWatch

log = logging.getLogger(__name__)


class RecordWriter(Protocol):
    def write(self, record: dict) -> None: ...


def staleness(group: common_pb2.TrajectoryGroup, version: int) -> int:
    """Learner version minus the oldest version that produced any token of the group."""
    return version - min((s.min_version for s in group.samples), default=version)


class Admission:
    def __init__(self, trajectories: StreamQueue, dropped_log: RecordWriter, *, max_staleness: int,
                 drop_zero_advantage_groups: bool, ledger: Ledger, bounds: Bounds,
                 watch: StallWatch | None = None) -> None:
        """`ledger` says what this run issued under a group's id while it is outstanding (and whether
        an earlier learner process of the run issued it: only such a group may come back generated
        by weights newer than the learner's); a group admitted back is struck off it here."""
        self.trajectories, self.dropped_log = trajectories, dropped_log
        self.k, self.drop_flat = max_staleness, drop_zero_advantage_groups
        self.ledger, self.bounds = ledger, bounds
        self.watch = watch  # told of each group that failed as a whole, and of each one's reward signal
        self.trained_groups: set[str] = set()
        # Admitted into the buffer and not trained yet: a second copy (a re-issued group whose
        # first copy also arrived) is a duplicate, never a second training sample.
        self.buffered: set[str] = set()
        # What was issued under each train group id that came back (run id, split, sample count and
        # issue version only), kept for the run like `trained_groups`: a later copy is still validated.
        self.back: dict[str, common_pb2.PromptGroup] = {}
        # Outstanding groups whose copies so far were all malformed: id -> (when the first came, what
        # was issued under it).
        self.malformed: dict[str, tuple[float, common_pb2.PromptGroup]] = {}
        # Ids retired after malformed copies -> the id the group was issued again under ("": an earlier
        # process's group, whose prompt this process does not have, is only retired).
        self.retired: dict[str, str] = {}
        self.num_dropped_stale = 0
        self.num_dropped_other = 0
        self.num_duplicates = 0
        self.num_dropped_invalid = 0  # not issued by this run, or malformed
        # Groups dropped as all-equal (dynamic sampling) since the last step: their samples' rewards,
        # so that the reward of everything generated is still reported (`take_flat_rewards`).
        self.flat_rewards: list[float] = []
        self.num_dropped_flat = 0
        self.num_reissued_after_invalid = 0

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
        issued = self.ledger.issued(group)
        if issued is None:
            issued = self.back.get(group.group_id)
        if issued is None:
            reason = "not issued by this run (unknown group id)"
        elif (group.prompt.split == "train" and max((s.max_version for s in group.samples), default=0) > version
              and self.ledger.issued_before_restart(group.group_id)):
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
        """True if a newly arrived train group goes into the training buffer. It is validated first,
        whatever became of its id; only a well-formed copy can be back, a duplicate or late."""
        gid = group.group_id
        issued = self.ledger.issued(group)
        already_back = issued is None or gid in self.trained_groups or gid in self.buffered
        if self.check(group, version):
            if not already_back:  # the rollout server's well-formed copy may still come
                self.malformed.setdefault(gid, (time.monotonic(), issued))
            await self.trajectories.ack(entry.id)
            return False
        if already_back:
            await self._drop_copy(entry, group, version)
            return False
        self.malformed.pop(gid, None)
        self.ledger.returned(gid)
        self._keep(gid, issued)
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
            self.num_dropped_flat += 1
            self.flat_rewards.extend(s.reward for s in valid)
            reason = f"all rewards equal ({valid[0].reward:g}; dynamic sampling)"
        if reason:
            self.num_dropped_other += 1
            await self._drop(entry, group, version, reason)
        else:
            self.buffered.add(group.group_id)
        if self.watch is not None:
            if len(valid) < 2:
                self.watch.group_failed(group, reason)
            else:
                self.watch.scored([s.reward for s in valid])
        return not reason

    COUNTERS = ("num_dropped_stale", "num_dropped_other", "num_dropped_invalid", "num_dropped_flat",
                "num_duplicates", "num_reissued_after_invalid")

    def counters(self) -> dict[str, int]:
        """What admission counted so far (train records and checkpoints carry them)."""
        return {name: getattr(self, name) for name in self.COUNTERS}

    def take_flat_rewards(self) -> list[float]:
        """The rewards of the samples in groups dropped as all-equal since the last call."""
        rewards, self.flat_rewards = self.flat_rewards, []
        return rewards

    def _keep(self, group_id: str, issued: common_pb2.PromptGroup) -> None:
        """Keep what was issued under a group id that is back, for validating later copies."""
        self.back[group_id] = common_pb2.PromptGroup(run_id=issued.run_id, split=issued.split, n=issued.n,
                                                     issued_at_version=issued.issued_at_version)

    async def _drop_copy(self, entry: Entry, group: common_pb2.TrajectoryGroup, version: int) -> None:
        """A well-formed copy of a group already back (a duplicate), or of an id retired after
        malformed copies (never trained beside the group issued in its place)."""
        new_id = self.retired.get(group.group_id)
        if new_id is None:
            self.num_duplicates += 1
            await self.trajectories.ack(entry.id)
            return
        self.num_dropped_other += 1
        await self._drop(entry, group, version, "a late copy of a group retired after malformed copies"
                         + (f" and issued again as {new_id}" if new_id else ""))

    def overdue(self, timeout_s: float) -> list[str]:
        """Outstanding group ids whose first malformed copy came over `timeout_s` ago with no
        well-formed copy since: time to issue them again."""
        cutoff = time.monotonic() - timeout_s
        return [gid for gid, (since, _) in self.malformed.items() if since <= cutoff]

    def retire(self, group_id: str, new_id: str) -> None:
        """`group_id` (overdue) is retired, by the issuer too (`PromptIssuer.reissue`): issued again
        as `new_id` ("": not issued again). A later copy of it is still validated, and never trained."""
        _, issued = self.malformed.pop(group_id)
        self._keep(group_id, issued)
        self.retired[group_id] = new_id
        self.num_reissued_after_invalid += bool(new_id)

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
