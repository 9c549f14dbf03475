"""Prompt issuing: turns dataset examples into prompt groups on the prompt stream, and keeps at
most (max_staleness + 1) * groups_per_step train groups outstanding, so that nothing older than
`max_staleness` is ever generated: rollout servers hold version >= v when they read a group issued at
version v (a broadcast finishes before new groups are issued).

Every group it publishes goes into the run's ledger of outstanding work (`rlmesh.learner.rl.ledger`),
which the other parties read; a queue server that restarted without its data gets every outstanding
group again (`reissue_outstanding`), so that nothing is lost.

A group whose copies all came back malformed is issued again by `reissue` under a fresh id: the
queue publishes a key at most once per stream, so the same id would be skipped on the prompt stream,
and on the trajectory stream if a forger published a copy under it first."""

from __future__ import annotations

from google.protobuf.struct_pb2 import Struct

from rlmesh.learner.data.examples import Example, TrainData, in_order
from rlmesh.learner.rl.ledger import Ledger
from rlmesh.v1 import common_pb2
from rlmesh.services.queue import StreamQueue
from rlmesh.services.telemetry import group_span

PUBLISH_BATCH = 256
"""Prompt groups `issue_train` publishes in one queue round trip (`StreamQueue.publish_many`, one script):
one round trip each, a step's worth at a thousand rollout servers took seconds of the learner's step."""


class PromptIssuer:
    def __init__(self, prompts: StreamQueue, run_id: str, train_set: TrainData | list[Example], *, group_size: int,
                 groups_per_step: int, max_staleness: int, ledger: Ledger | None = None) -> None:
        self.prompts, self.run_id, self.train_set = prompts, run_id, in_order(train_set)
        self.group_size, self.B, self.k = group_size, groups_per_step, max_staleness
        self.ledger = ledger if ledger is not None else Ledger(group_size)
        self.num_issued = 0
        self.num_reissued = 0
        self.cursor = 0  # next train example, `train_set.at(cursor)` (saved in checkpoints)

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
        """`group` in the ledger, serialized, ready to publish."""
        # The group's trace starts here; its context rides on the message to every tier.
        with group_span("issue", group.group_id, carrier=group.trace_context, version=group.issued_at_version,
                        split=group.split):
            data = group.SerializeToString()
        self.ledger.record(group, data)
        return group.group_id, data

    async def publish(self, group: common_pb2.PromptGroup) -> None:
        await self.prompts.publish(*self._record(group))

    async def issue_train(self, num_buffered: int, version: int, steps: int | None = None) -> int:
        """Top the outstanding train groups (in flight + buffered) back up to the bound, or to
        `steps` steps' worth where that is given (fewer than the bound); returns how many were issued."""
        steps = self.k + 1 if steps is None else min(steps, self.k + 1)
        budget = max(steps * self.B - self.ledger.in_flight - num_buffered, 0)
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

    async def reissue(self, group_id: str, version: int) -> str:
        """Retire the outstanding group `group_id` and issue its prompt again at `version` under a
        fresh id, which takes its place in flight; returns the new id, or "" for a group an earlier
        process issued (its prompt is not known here: it is only retired)."""
        old = self.ledger.prompt(group_id)
        self.ledger.returned(group_id)
        if old is None:
            return ""
        example_id = group_id.removeprefix(f"{old.run_id}/{old.split}/").split("/", 1)[1]
        group = common_pb2.PromptGroup()
        group.CopyFrom(old)
        group.ClearField("trace_context")  # a trace of its own, started by `publish`
        group.group_id, group.issued_at_version = self._next_id(old.split, example_id), version
        await self.publish(group)
        return group.group_id

    async def reissue_outstanding(self) -> int:
        """Publish every outstanding group again (their entries were lost with the queue)."""
        outstanding = list(self.ledger.outstanding.items())
        for group_id, (_, data) in outstanding:
            await self.prompts.publish(group_id, data)
        self.num_reissued += len(outstanding)
        return len(outstanding)
