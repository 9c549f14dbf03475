"""The learner's issuing and admission rules, with a recording fake in place of the Redis stream."""

import pytest

from rlmesh.learner.admission import Admission
from rlmesh.learner.data import Example
from rlmesh.learner.issuer import PromptIssuer
from rlmesh.learner.validation import Bounds
from rlmesh.v1 import common_pb2
from rlmesh.services.queue import Entry


class FakeQueue:
    def __init__(self):
        self.published: list[str] = []
        self.acked: list[str] = []

    async def publish(self, key, data, **_):
        self.published.append(key)
        return key

    async def publish_many(self, items, **_):
        return len([await self.publish(key, data) for key, data in items])

    async def ack(self, *ids):
        self.acked.extend(ids)
        return len(ids)


class Records:
    def __init__(self):
        self.rows = []

    def write(self, record):
        self.rows.append(record)


def _issuer(k: int = 1, groups_per_step: int = 4) -> PromptIssuer:
    train = [Example(str(i), [{"role": "user", "content": f"{i}+1="}], "arithmetic", {"answer": str(i + 1)})
             for i in range(10)]
    return PromptIssuer(FakeQueue(), "run", train, group_size=8, groups_per_step=groups_per_step, max_staleness=k)


def _admission(k: int = 1, drop_flat: bool = False, issuer: PromptIssuer | None = None) -> Admission:
    issuer = issuer or _issuer(k)
    # Every group counts as issued here (the issued-by-this-run rule: tests/unit/learner/test_validation.py).
    return Admission(FakeQueue(), Records(), max_staleness=k, drop_zero_advantage_groups=drop_flat,
                     on_returned=issuer.returned, bounds=Bounds(vocab_size=100, max_abs_reward=1e4, max_seq_len=64),
                     issued=lambda g: common_pb2.PromptGroup(split="train", n=len(g.samples)))


def _group(gid: str, versions: list[tuple[int, int]], errors: int = 0, rewards=None) -> tuple[Entry, common_pb2.TrajectoryGroup]:
    samples = [common_pb2.Sample(index=i, min_version=lo, max_version=hi, reward=(rewards or [1.0, 0.0] * 4)[i],
                                 error="boom" if i < errors else "") for i, (lo, hi) in enumerate(versions)]
    group = common_pb2.TrajectoryGroup(group_id=gid, samples=samples, prompt_token_ids=[1],
                                       prompt=common_pb2.PromptGroup(group_id=gid, split="train"))
    return Entry(id=f"e-{gid}", key=gid, data=b""), group


async def test_issuance_keeps_at_most_k_plus_one_steps_outstanding():
    issuer = _issuer(k=1, groups_per_step=4)
    await issuer.issue_train(num_buffered=0, version=0)
    assert issuer.in_flight == 8 and len(issuer.prompts.published) == 8
    await issuer.issue_train(num_buffered=0, version=0)
    assert len(issuer.prompts.published) == 8, "no more than (k+1)*B outstanding"
    for gid in issuer.prompts.published[:4]:
        issuer.returned(gid)
    assert issuer.in_flight == 4
    await issuer.issue_train(num_buffered=4, version=1)
    assert len(issuer.prompts.published) == 8, "buffered groups count as outstanding"


async def test_synchronous_mode_issues_exactly_one_step():
    issuer = _issuer(k=0, groups_per_step=4)
    await issuer.issue_train(num_buffered=0, version=0)
    assert issuer.in_flight == 4


def test_prompt_groups_carry_messages_and_opaque_metadata():
    issuer = _issuer()
    ex = Example("x", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}], "custom",
                 {"answer": "4", "tags": ["a", "b"], "nested": {"k": 1}})
    group = issuer.prompt_group(ex, "train", 8, version=3, greedy=False)
    assert [(m.role, m.content) for m in group.messages] == [("system", "be brief"), ("user", "2+2=")]
    assert group.env_name == "custom" and group.issued_at_version == 3
    from google.protobuf.json_format import MessageToDict

    assert MessageToDict(group.env_metadata) == {"answer": "4", "tags": ["a", "b"], "nested": {"k": 1}}


async def test_fresh_group_is_accepted():
    issuer = _issuer()
    issuer.unknown_in_flight = 5
    admission = _admission(issuer=issuer)
    assert await admission.accept(*_group("a", [(2, 3)] * 4), version=3)
    assert issuer.in_flight == 4 and admission.trajectories.acked == []


async def test_too_stale_group_is_dropped_counted_and_acked():
    issuer = _issuer()
    issuer.unknown_in_flight = 3
    admission = _admission(k=1, issuer=issuer)
    assert not await admission.accept(*_group("old", [(3, 4), (4, 4), (4, 4), (4, 4)]), version=5)
    assert admission.num_dropped_stale == 1 and admission.trajectories.acked == ["e-old"]
    assert issuer.in_flight == 2
    assert admission.dropped_log.rows[0]["reason"] == "staleness 2 > max_staleness 1"


async def test_duplicate_of_a_trained_group_is_acked_without_counting_in_flight():
    issuer = _issuer()
    issuer.unknown_in_flight = 2
    admission = _admission(issuer=issuer)
    admission.trained_groups.add("dup")
    assert not await admission.accept(*_group("dup", [(0, 0)] * 4), version=0)
    assert admission.num_duplicates == 1 and issuer.in_flight == 2 and admission.trajectories.acked == ["e-dup"]


async def test_group_from_weights_lost_in_a_restart_is_dropped():
    admission = _admission()
    assert not await admission.accept(*_group("future", [(5, 5)] * 4), version=4)
    assert admission.num_dropped_other == 1


async def test_group_with_fewer_than_two_valid_samples_is_dropped():
    admission = _admission()
    assert not await admission.accept(*_group("errs", [(0, 0)] * 4, errors=3), version=0)
    assert admission.num_dropped_other == 1


@pytest.mark.parametrize("drop", [True, False])
async def test_dynamic_sampling_drops_groups_without_signal(drop):
    admission = _admission(drop_flat=drop)
    accepted = await admission.accept(*_group("flat", [(0, 0)] * 4, rewards=[1.0] * 4), version=0)
    assert accepted is (not drop)


async def test_a_group_already_buffered_is_a_duplicate_not_a_second_sample():
    admission = _admission()
    assert await admission.accept(*_group("g", [(0, 0)] * 4), version=0)
    entry, group = _group("g", [(0, 0)] * 4)
    assert not await admission.accept(Entry(id="e-g2", key="g", data=b""), group, version=0)
    assert admission.num_duplicates == 1 and admission.trajectories.acked == ["e-g2"]
    admission.trained("g")
    assert not await admission.accept(Entry(id="e-g3", key="g", data=b""), group, version=1)
    assert admission.num_duplicates == 2


async def test_outstanding_groups_are_reissued_after_queue_loss():
    issuer = _issuer(k=0, groups_per_step=3)
    await issuer.issue_train(num_buffered=0, version=0)
    first = list(issuer.prompts.published)
    issuer.returned(first[0])
    assert await issuer.reissue_outstanding() == 2
    assert issuer.prompts.published[3:] == first[1:] and issuer.num_reissued == 2
