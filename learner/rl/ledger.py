"""The run's ledger of outstanding work: every prompt group issued and not back yet. The issuer writes
it (what it publishes, what it issues again); admission, the reader, the evaluator, the checks and the
metrics read it, and admission strikes a group off when it comes back. No party asks another.

It is what a returning group is checked against (`issued`): a group id this run never issued, or one
already back, is not this run's work and changes no count. And it is what a queue server that
restarted without its data gets again (`PromptIssuer.reissue_outstanding`), so that nothing is lost.

After a learner restart the groups an earlier process issued are known only by number
(`unknown_in_flight`, from the checkpoint) and by that process's run id (`earlier_run_ids`): such a
group is recognised by its id's prefix when it comes back."""

from __future__ import annotations

from rlmesh.v1 import common_pb2


class Ledger:
    def __init__(self, group_size: int) -> None:
        self.group_size = group_size  # the sample count of a group an earlier process issued
        # Issued and not back yet: group id -> (split, serialized PromptGroup) ...
        self.outstanding: dict[str, tuple[str, bytes]] = {}
        # ... and the same groups as messages, for `issued` (a thousand decodes a step saved).
        self._groups: dict[str, common_pb2.PromptGroup] = {}
        self.unknown_in_flight = 0
        self.earlier_run_ids: set[str] = set()
        self._earlier_back: set[str] = set()

    @property
    def in_flight(self) -> int:
        """Train groups issued and not yet back."""
        return sum(1 for split, _ in self.outstanding.values() if split == "train") + self.unknown_in_flight

    def holds(self, group_id: str) -> bool:
        """Whether `group_id` was issued by this process and is not back yet."""
        return group_id in self.outstanding

    def record(self, group: common_pb2.PromptGroup, data: bytes) -> None:
        """`group` (serialized as `data`) was issued."""
        self.outstanding[group.group_id] = (group.split, data)
        self._groups[group.group_id] = group

    def prompt(self, group_id: str) -> common_pb2.PromptGroup | None:
        """What this process issued under `group_id`, while it is outstanding."""
        return self._groups.get(group_id)

    def issued(self, group: common_pb2.TrajectoryGroup) -> common_pb2.PromptGroup | None:
        """The prompt group this run issued under `group`'s id, if it is still outstanding; for a
        group of an earlier process of this run (after a restart), its own prompt with the sample
        count that process issued. None for a group id this run did not issue or already got back."""
        issued = self._groups.get(group.group_id)
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

    def resume(self, num_in_flight: int) -> None:
        """After a restart: `num_in_flight` train groups an earlier process issued count as in flight
        until they come back (`earlier_run_ids` names those processes)."""
        self.unknown_in_flight = num_in_flight

    def returned(self, group_id: str) -> None:
        """A group came back (to be trained, dropped or not), or was retired to be issued again."""
        self._groups.pop(group_id, None)
        if self.outstanding.pop(group_id, None) is None:
            self._earlier_back.add(group_id)
            self.unknown_in_flight = max(self.unknown_in_flight - 1, 0)
