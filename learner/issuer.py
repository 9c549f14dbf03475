"""Prompt issuing: turns dataset examples into prompt groups on the prompt stream, and keeps at
most (max_staleness + 1) * groups_per_step train groups outstanding, so that nothing older than
`max_staleness` is ever generated: generators hold version >= v when they read a group issued at
version v (a broadcast finishes before new groups are issued).

It also remembers every group it issued that has not come back, so that a queue server that
restarted without its data loses nothing: `reissue_outstanding` publishes them all again. That
record is also what a returning group is checked against (`issued`): a group id this run never
issued, or one already back, is not this run's work and changes no count."""

from __future__ import annotations

from google.protobuf.struct_pb2 import Struct

from rlmesh.learner.data import Example, TrainData, in_order
from rlmesh.v1 import common_pb2
from rlmesh.services.queue import StreamQueue
from rlmesh.services.telemetry import group_span

PUBLISH_BATCH = 256
"""Prompt groups `issue_train` publishes in one queue round trip (a pipeline): one round trip each,
a step's worth at a thousand rollout servers took seconds of the learner's step."""


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

    def prompt_group(self, ex: Example, split: str, n: int, version: int, greedy: bool) -> common_pb2.PromptGroup:
        self.num_issued += 1
        metadata = Struct()
        metadata.update(ex.metadata)
        group = common_pb2.PromptGroup(
            group_id=f"{self.run_id}/{split}/{self.num_issued}/{ex.id}", run_id=self.run_id,
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
        for i in range(0, len(groups), PUBLISH_BATCH):
            await self.prompts.publish_many([self._record(g) for g in groups[i:i + PUBLISH_BATCH]])
        return budget

    def issued(self, group: common_pb2.TrajectoryGroup) -> common_pb2.PromptGroup | None:
        """The prompt group this run issued under `group`'s id, if it is still outstanding; for a
        group of an earlier process of this run (after a restart), its own prompt with the sample
        count that process issued. None for a group id this run did not issue or already got back."""
        issued = self._issued_groups.get(group.group_id)
        if issued is not None:
            return issued
        run_id = group.group_id.split("/", 1)[0]
        if run_id in self.earlier_run_ids and group.prompt.split == "train" and group.group_id not in self._earlier_back:
            issued = common_pb2.PromptGroup()
            issued.CopyFrom(group.prompt)
            issued.run_id, issued.n = run_id, self.group_size
            return issued
        return None

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
