"""The trajectory stream as the learner reads it, for training and evaluation alike: each read
checks that the queue server still holds this run's data (re-issuing every outstanding prompt
group if it lost it), decodes what arrived and says so in the log when nothing has for a while.
(Bringing out-of-date rollout servers to the learner's weights before a read is the controller's call,
`WeightBroadcaster.catch_up`.)
While a training step runs, `admit_during` reads and admits what arrives, so that decoding and
validating a step's worth of groups is not on the step's critical path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from rlmesh.services.queue import Entry
from rlmesh.v1 import common_pb2

if TYPE_CHECKING:
    from rlmesh.learner.rl.admission import Admission
    from rlmesh.learner.rl.issuer import PromptIssuer
    from rlmesh.learner.rl.membership import Membership
    from rlmesh.learner.trackers.metrics import MetricsWriter
    from rlmesh.learner.rl.watch import StallWatch
    from rlmesh.services.queue import StreamQueue

log = logging.getLogger(__name__)

# What a read brings: each trajectory-stream entry with its decoded group.
Arrivals = list[tuple[Entry, common_pb2.TrajectoryGroup]]

CONSUMER = "learner"  # the learner's consumer name in the trajectory stream's consumer group
DURING_STEP_BLOCK_MS = 20
"""How long one read in `admit_during` waits for arrivals: the step's end is noticed within it."""


async def mark_queues(prompts: StreamQueue, trajectories: StreamQueue, run_id: str) -> None:
    """Create the streams' consumer groups where missing and mark the queue server with this run:
    a marker that vanishes says the server lost its data (`TrajectoryReader._check_queue`)."""
    await prompts.ensure_group()
    await trajectories.ensure_group()
    await prompts.set_marker("run", run_id)


class TrajectoryReader:
    def __init__(self, prompts: StreamQueue, trajectories: StreamQueue, *, run_id: str, issuer: PromptIssuer,
                 admission: Admission, membership: Membership, metrics: MetricsWriter,
                 watch: StallWatch | None = None) -> None:
        from rlmesh.learner.rl.watch import DeadLetters

        self.prompts, self.trajectories, self.run_id = prompts, trajectories, run_id
        self.issuer, self.admission, self.membership, self.metrics = issuer, admission, membership, metrics
        self.watch, self.dead_letters = watch, DeadLetters(prompts)
        self._group_recreations = 0
        self._last_queue_check = self._last_arrival = self._last_wait_log = self._last_alert = time.monotonic()
        self._reading = False  # the silence is counted from the first read (rollout servers registered)

    async def read(self, version: int) -> Arrivals:
        """What arrived within half a second (possibly nothing), with the learner at `version`."""
        if time.monotonic() - self._last_queue_check > 1.0:
            self._last_queue_check = time.monotonic()
            await self._check_queue(version)
            await self._check_rejected()
        if not self._reading:
            self._reading, self._last_arrival = True, time.monotonic()
        entries = await self.trajectories.read(CONSUMER, count=256, block_ms=500)
        out = await self._decode(entries)
        now = time.monotonic()
        if entries:
            self._last_arrival = now
        elif now - self._last_arrival > 30 and now - self._last_wait_log > 30:
            self._last_wait_log = now
            depth = await self.prompts.depth()
            gens = ", ".join(f"{g.generator_id}@v{g.version}" for g in self.membership.generators.values()) or "none"
            message = (f"no trajectories for {now - self._last_arrival:.0f}s: {self.issuer.ledger.in_flight} groups in flight, "
                       f"prompt stream {depth.length} unacked ({depth.lag} undelivered), rollout servers: {gens}")
            if self.watch is not None and now - self._last_arrival > 60 and now - self._last_alert > 60:
                self._last_alert = now  # on the console too (an alert row), once a minute
                self.watch.alert(message + " (generation may just be slow; if this goes on, logs/rollout-*.log say why)")
            else:
                log.warning("%s", message)
        return out

    async def _decode(self, entries) -> Arrivals:
        out = []
        for entry in entries:
            try:
                out.append((entry, common_pb2.TrajectoryGroup.FromString(entry.data)))
            except DecodeError as err:
                await self.admission.drop_undecodable(entry, err)
        return out

    async def admit_during(self, busy: asyncio.Future, version: int, ready: Arrivals, held_back: Arrivals,
                           refill: Callable[[int], Awaitable[object]] | None = None) -> None:
        """Until `busy` (a training step at learner `version`) is done: admit arriving train groups
        into `ready` at `version`, and keep the others (evaluation rounds) in `held_back` for the
        next fill. The caller re-checks staleness once the version moves on, as for any leftover.
        No catch-up broadcast starts here (it would wait for the step, with servers paused), and a
        read is never cancelled: it returns within DURING_STEP_BLOCK_MS of the step's end; what it
        brings after the step's end goes to `held_back` unadmitted (the next fill admits it).
        After each read that brought a train group and admitted none (dropped, e.g. all rewards
        equal), `refill(len(ready))` is awaited: the caller issues prompts in place of what was
        dropped, rather than leaving the rollout tier idle until the step ends."""
        while not busy.done():
            entries = await self.trajectories.read(CONSUMER, count=256, block_ms=DURING_STEP_BLOCK_MS)
            if entries:
                self._last_arrival = time.monotonic()
            dropped = False
            for entry, group in await self._decode(entries):
                if group.prompt.split != "train" or busy.done():
                    held_back.append((entry, group))
                elif await self.admission.accept(entry, group, version):
                    ready.append((entry, group))
                else:
                    dropped = True
            if dropped and refill is not None and not busy.done():
                await refill(len(ready))

    async def replay_pending(self) -> Arrivals:
        """This consumer's entries delivered before a restart and never acked (an undecodable one is
        acked and left out)."""
        out = []
        for entry in await self.trajectories.read_own_pending(CONSUMER, count=100000):
            try:
                out.append((entry, common_pb2.TrajectoryGroup.FromString(entry.data)))
            except DecodeError:
                await self.trajectories.ack(entry.id)
        return out

    async def _check_rejected(self) -> None:
        """Prompt groups of this run that a rollout server rejected (dead-lettered) are not coming
        back: they leave the in-flight count, and the stall watch hears why."""
        for group_id, by, reason in await self.dead_letters.poll():
            if not self.issuer.ledger.holds(group_id):
                continue  # another run's, or one already accounted for
            self.issuer.ledger.returned(group_id)
            log.error("prompt group %s rejected by rollout server %s: %s", group_id, by, reason)
            if self.watch is not None:
                self.watch.failed(f"rollout server {by}", reason, by)

    async def _check_queue(self, version: int) -> None:
        """Detect a queue server that came back empty (its run marker or a consumer group is gone):
        re-create what is needed and re-issue every outstanding prompt group, counted."""
        recreations = self.prompts.num_group_recreations + self.trajectories.num_group_recreations
        if await self.prompts.get_marker("run") is not None and recreations == self._group_recreations:
            return
        self._group_recreations = recreations
        await mark_queues(self.prompts, self.trajectories, self.run_id)
        n = await self.issuer.reissue_outstanding()
        log.error("the queue server lost its data (run marker or consumer group gone): re-issued %d outstanding "
                  "prompt groups; trained-but-unacked trajectories stay covered by the next checkpoint", n)
        self.metrics.write({"kind": "queue_loss", "version": version, "num_reissued": n})
