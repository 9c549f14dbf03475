"""Prompt issuing: turns dataset examples into prompt groups on the prompt stream, and keeps at
most (max_staleness + 1) * groups_per_step train groups outstanding, so that nothing older than
`max_staleness` is ever generated: generators hold version >= v when they read a group issued at
version v (a broadcast finishes before new groups are issued).

It also remembers every group it issued that has not come back, so that a queue server that
restarted without its data loses nothing: `reissue_outstanding` publishes them all again. That
record is also what a returning group is checked against (`issued`): a group id this run never
issued, or one already back, is not this run's work and changes no count.

A group whose copies all came back malformed is issued again by `reissue` under a fresh id: the
queue publishes a key at most once per stream, so the same id would be skipped on the prompt stream,
and on the trajectory stream if a forger published a copy under it first."""

from __future__ import annotations

from google.protobuf.struct_pb2 import Struct

from rlmesh.learner.data.examples import Example, TrainData, in_order
from rlmesh.v1 import common_pb2
from rlmesh.services.queue import StreamQueue
from rlmesh.services.telemetry import group_span

PUBLISH_BATCH = 256
"""Prompt groups `issue_train` publishes in one queue round trip (`StreamQueue.publish_many`, one script):
one round trip each, a step's worth at a thousand rollout servers took seconds of the learner's step."""


class PromptIssuer:
    def __init__(self, prompts: StreamQueue, run_id: str, train_set: TrainData | list[Example], *, group_size: int,
                 groups_per_step: int, max_staleness: int) -> None:
        self.prompts, self.run_id, self.train_set = prompts, run_id, in_order(train_set)
        self.group_size, self.B, self.k = group_size, groups_per_step, max_staleness
        # Issued and not back yet: group id -> (split, serialized PromptGroup).
        self.outstanding: dict[str, tuple[str, bytes]] = {}
        # The same groups as messages, for `issued` (a thousand decodes a step saved).
        self._issued_groups: dict[str, common_pb2.PromptGroup] = {}
        # Train groups issued by an earlier process (after a restart), known only by count, and
        # the run ids of those processes (their groups are recognised by the id's prefix).
        self.unknown_in_flight = 0
        self.earlier_run_ids: set[str] = set()
        self._earlier_back: set[str] = set()
        self.num_issued = 0
        self.num_reissued = 0
        self.cursor = 0  # next train example, `train_set.at(cursor)` (saved in checkpoints)

    @property
    def in_flight(self) -> int:
        """Train groups issued and not yet back."""
        return sum(1 for split, _ in self.outstanding.values() if split == "train") + self.unknown_in_flight

    def _next_id(self, split: str, example_id: str) -> str:
        self.num_issued += 1
        return f"{self.run_id}/{split}/{self.num_issued}/{example_id}"

    def prompt_group(self, ex: Example, split: str, n: int, version: int, greedy: bool) -> common_pb2.PromptGroup:
        metadata = Struct()
        metadata.update(ex.metadata)
        group = common_pb2.PromptGroup(
            group_id=self._next_id(split, ex.id), run_id=self.run_id,
            messages=[common_pb2.ChatMessage(**m) for m in ex.prompt_messages], env_name=ex.env,
            env_metadata=metadata, n=n, issued_at_version=version, split=split)
        if greedy:
            group.sampling.temperature = 0.0
        return group

    def _record(self, group: common_pb2.PromptGroup) -> tuple[str, bytes]:
        """`group` as outstanding, serialized, ready to publish."""
        # The group's trace starts here; its context rides on the message to every tier.
        with group_span("issue", group.group_id, carrier=group.trace_context, version=group.issued_at_version,
                        split=group.split):
            data = group.SerializeToString()
        self.outstanding[group.group_id] = (group.split, data)
        self._issued_groups[group.group_id] = group
        return group.group_id, data

    async def publish(self, group: common_pb2.PromptGroup) -> None:
        await self.prompts.publish(*self._record(group))

    async def issue_train(self, num_buffered: int, version: int) -> int:
        """Top the outstanding train groups (in flight + buffered) back up to the bound; returns
        how many were issued."""
        budget = max((self.k + 1) * self.B - self.in_flight - num_buffered, 0)
        groups = []
        for _ in range(budget):
            ex = self.train_set.at(self.cursor)
            self.cursor += 1
            groups.append(self.prompt_group(ex, "train", self.group_size, version, greedy=False))
        # All recorded as outstanding before the first publish yields: an issue_train running beside
        # this one (a refill during a step) sees them in flight and issues no more than the bound.
        records = [self._record(g) for g in groups]
        for i in range(0, len(records), PUBLISH_BATCH):
            await self.prompts.publish_many(records[i:i + PUBLISH_BATCH])
        return budget

    def issued(self, group: common_pb2.TrajectoryGroup) -> common_pb2.PromptGroup | None:
        """The prompt group this run issued under `group`'s id, if it is still outstanding; for a
        group of an earlier process of this run (after a restart), its own prompt with the sample
        count that process issued. None for a group id this run did not issue or already got back."""
        issued = self._issued_groups.get(group.group_id)
        if issued is not None:
            return issued
        if (self.issued_before_restart(group.group_id) and group.prompt.split == "train"
                and group.group_id not in self._earlier_back):
            issued = common_pb2.PromptGroup()
            issued.CopyFrom(group.prompt)
            issued.run_id, issued.n = group.group_id.split("/", 1)[0], self.group_size
            return issued
        return None

    def issued_before_restart(self, group_id: str) -> bool:
        """Whether an earlier learner process of this run issued `group_id`."""
        return group_id.split("/", 1)[0] in self.earlier_run_ids

    async def reissue(self, group_id: str, version: int) -> str:
        """Retire the outstanding group `group_id` and issue its prompt again at `version` under a
        fresh id, which takes its place in flight; returns the new id, or "" for a group an earlier
        process issued (its prompt is not known here: it is only retired)."""
        old = self._issued_groups.get(group_id)
        self.returned(group_id)
        if old is None:
            return ""
        example_id = group_id.removeprefix(f"{old.run_id}/{old.split}/").split("/", 1)[1]
        group = common_pb2.PromptGroup()
        group.CopyFrom(old)
        group.ClearField("trace_context")  # a trace of its own, started by `publish`
        group.group_id, group.issued_at_version = self._next_id(old.split, example_id), version
        await self.publish(group)
        return group.group_id

    def resume(self, cursor: int, num_in_flight: int) -> None:
        """After a restart: continue the train data at `cursor`, and count `num_in_flight` groups
        that an earlier process issued (known only by number) as in flight until they come back."""
        self.cursor, self.unknown_in_flight = cursor, num_in_flight

    def returned(self, group_id: str) -> None:
        """A group came back (to be trained, dropped or not)."""
        self._issued_groups.pop(group_id, None)
        if self.outstanding.pop(group_id, None) is None:
            self._earlier_back.add(group_id)
            self.unknown_in_flight = max(self.unknown_in_flight - 1, 0)

    async def reissue_outstanding(self) -> int:
        """Publish every outstanding group again (their entries were lost with the queue)."""
        for group_id, (_, data) in list(self.outstanding.items()):
            await self.prompts.publish(group_id, data)
        self.num_reissued += len(self.outstanding)
        return len(self.outstanding)
