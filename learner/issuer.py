"""Prompt issuing: turns dataset examples into prompt groups on the prompt stream, and keeps at
most (max_staleness + 1) * groups_per_step train groups outstanding, so that nothing older than
`max_staleness` is ever generated: generators hold version >= v when they read a group issued at
version v (a broadcast finishes before new groups are issued).

It also remembers every group it issued that has not come back, so that a queue server that
restarted without its data loses nothing: `reissue_outstanding` publishes them all again."""

from __future__ import annotations

from google.protobuf.struct_pb2 import Struct

from rlmesh.learner.data import Example, TrainData, in_order
from rlmesh.v1 import common_pb2
from rlmesh.services.queue import StreamQueue


class PromptIssuer:
    def __init__(self, prompts: StreamQueue, run_id: str, train_set: TrainData | list[Example], *, group_size: int,
                 groups_per_step: int, max_staleness: int) -> None:
        self.prompts, self.run_id, self.train_set = prompts, run_id, in_order(train_set)
        self.group_size, self.B, self.k = group_size, groups_per_step, max_staleness
        # Issued and not back yet: group id -> (split, serialized PromptGroup).
        self.outstanding: dict[str, tuple[str, bytes]] = {}
        # Train groups issued by an earlier process (after a restart), known only by count.
        self.unknown_in_flight = 0
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

    async def publish(self, group: common_pb2.PromptGroup) -> None:
        data = group.SerializeToString()
        self.outstanding[group.group_id] = (group.split, data)
        await self.prompts.publish(group.group_id, data)

    async def issue_train(self, num_buffered: int, version: int) -> int:
        """Top the outstanding train groups (in flight + buffered) back up to the bound; returns
        how many were issued."""
        budget = max((self.k + 1) * self.B - self.in_flight - num_buffered, 0)
        for _ in range(budget):
            ex = self.train_set.at(self.cursor)
            self.cursor += 1
            await self.publish(self.prompt_group(ex, "train", self.group_size, version, greedy=False))
        return budget

    def returned(self, group_id: str) -> None:
        """A group came back (to be trained, dropped or not)."""
        if self.outstanding.pop(group_id, None) is None and self.unknown_in_flight > 0:
            self.unknown_in_flight -= 1

    async def reissue_outstanding(self) -> int:
        """Publish every outstanding group again (their entries were lost with the queue)."""
        for group_id, (_, data) in list(self.outstanding.items()):
            await self.prompts.publish(group_id, data)
        self.num_reissued += len(self.outstanding)
        return len(self.outstanding)
