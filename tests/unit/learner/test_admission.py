"""The learner's issuing and admission rules, with a recording fake in place of the Redis stream."""

from pathlib import Path

import pytest

from rlmesh.learner.rl.admission import Admission
from rlmesh.learner.data.examples import Example
from rlmesh.learner.rl.issuer import PromptIssuer
from rlmesh.learner.rl.validation import Bounds
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


class AllIssued:
    """The issuer's ledger, except that every group counts as issued (by an earlier process if `restarted`)."""

    def __init__(self, ledger, restarted: bool) -> None:
        self.ledger, self.restarted = ledger, restarted

    def issued(self, group):
        return common_pb2.PromptGroup(split="train", n=len(group.samples))

    def issued_before_restart(self, group_id: str) -> bool:
        return self.restarted

    def returned(self, group_id: str) -> None:
        self.ledger.returned(group_id)


def _issuer(k: int = 1, groups_per_step: int = 4) -> PromptIssuer:
    train = [Example(str(i), [{"role": "user", "content": f"{i}+1="}], "arithmetic", {"answer": str(i + 1)})
             for i in range(10)]
    return PromptIssuer(FakeQueue(), "run", train, group_size=8, groups_per_step=groups_per_step, max_staleness=k)


def _admission(k: int = 1, drop_flat: bool = False, issuer: PromptIssuer | None = None,
               restarted: bool = False) -> Admission:
    issuer = issuer or _issuer(k)
    # Every group counts as issued here (the issued-by-this-run rule: tests/unit/learner/test_validation.py),
    # by an earlier learner process of the run if `restarted`.
    return Admission(FakeQueue(), Records(), max_staleness=k, drop_zero_advantage_groups=drop_flat,
                     ledger=AllIssued(issuer.ledger, restarted),
                     bounds=Bounds(vocab_size=100, max_abs_reward=1e4, max_seq_len=64))


def _group(gid: str, versions: list[tuple[int, int]], errors: int = 0, rewards=None) -> tuple[Entry, common_pb2.TrajectoryGroup]:
    samples = [common_pb2.Sample(index=i, min_version=lo, max_version=hi, reward=(rewards or [1.0, 0.0] * 4)[i],
                                 error="boom" if i < errors else "") for i, (lo, hi) in enumerate(versions)]
    group = common_pb2.TrajectoryGroup(group_id=gid, samples=samples, prompt_token_ids=[1],
                                       prompt=common_pb2.PromptGroup(group_id=gid, split="train"))
    return Entry(id=f"e-{gid}", key=gid, data=b""), group


async def test_issuance_keeps_at_most_k_plus_one_steps_outstanding():
    issuer = _issuer(k=1, groups_per_step=4)
    await issuer.issue_train(num_buffered=0, version=0)
    assert issuer.ledger.in_flight == 8 and len(issuer.prompts.published) == 8
    await issuer.issue_train(num_buffered=0, version=0)
    assert len(issuer.prompts.published) == 8, "no more than (k+1)*B outstanding"
    for gid in issuer.prompts.published[:4]:
        issuer.ledger.returned(gid)
    assert issuer.ledger.in_flight == 4
    await issuer.issue_train(num_buffered=4, version=1)
    assert len(issuer.prompts.published) == 8, "buffered groups count as outstanding"


async def test_synchronous_mode_issues_exactly_one_step():
    issuer = _issuer(k=0, groups_per_step=4)
    await issuer.issue_train(num_buffered=0, version=0)
    assert issuer.ledger.in_flight == 4


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
    issuer.ledger.unknown_in_flight = 5
    admission = _admission(issuer=issuer)
    assert await admission.accept(*_group("a", [(2, 3)] * 4), version=3)
    assert issuer.ledger.in_flight == 4 and admission.trajectories.acked == []


async def test_too_stale_group_is_dropped_counted_and_acked():
    issuer = _issuer()
    issuer.ledger.unknown_in_flight = 3
    admission = _admission(k=1, issuer=issuer)
    assert not await admission.accept(*_group("old", [(3, 4), (4, 4), (4, 4), (4, 4)]), version=5)
    assert admission.num_dropped_stale == 1 and admission.trajectories.acked == ["e-old"]
    assert issuer.ledger.in_flight == 2
    assert admission.dropped_log.rows[0]["reason"] == "staleness 2 > max_staleness 1"


async def test_duplicate_of_a_trained_group_is_acked_without_counting_in_flight():
    issuer = _issuer()
    issuer.ledger.unknown_in_flight = 2
    admission = _admission(issuer=issuer)
    admission.trained_groups.add("dup")
    assert not await admission.accept(*_group("dup", [(0, 0)] * 4), version=0)
    assert admission.num_duplicates == 1 and issuer.ledger.in_flight == 2 and admission.trajectories.acked == ["e-dup"]


async def test_group_from_weights_lost_in_a_restart_is_dropped():
    admission = _admission(restarted=True)
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


async def test_dropped_all_equal_groups_keep_their_rewards_for_the_step_record():
    admission = _admission(drop_flat=True)
    assert not await admission.accept(*_group("right", [(0, 0)] * 4, rewards=[1.0] * 4), version=0)
    assert not await admission.accept(*_group("wrong", [(0, 0)] * 4, rewards=[0.0] * 4), version=0)
    assert await admission.accept(*_group("mixed", [(0, 0)] * 4), version=0)
    assert admission.num_dropped_flat == 2 and admission.num_dropped_other == 2
    assert admission.take_flat_rewards() == [1.0] * 4 + [0.0] * 4
    assert admission.take_flat_rewards() == []  # counted in one step's record only
    assert [r["reason"] for r in admission.dropped_log.rows] == [
        "all rewards equal (1; dynamic sampling)", "all rewards equal (0; dynamic sampling)"]


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
    issuer.ledger.returned(first[0])
    assert await issuer.reissue_outstanding() == 2
    assert issuer.prompts.published[3:] == first[1:] and issuer.num_reissued == 2


# A malformed copy never costs the real group (a real issuer and admission; the learner's loop
# issues overdue groups again, `Controller._reissue_malformed`).

BOUNDS = Bounds(vocab_size=100, max_abs_reward=1e4, max_seq_len=64)


async def _issued_groups(num: int = 4):
    issuer = _issuer(k=1, groups_per_step=num // 2)
    await issuer.issue_train(num_buffered=0, version=3)
    admission = Admission(FakeQueue(), Records(), max_staleness=1, drop_zero_advantage_groups=False,
                          ledger=issuer.ledger, bounds=BOUNDS)
    return issuer, admission, [issuer.ledger._groups[gid] for gid in issuer.prompts.published]


def _answer(prompt: common_pb2.PromptGroup, malformed: bool = False) -> tuple[Entry, common_pb2.TrajectoryGroup]:
    """The rollout server's answer to `prompt`; `malformed`: a copy with a token id outside the vocabulary."""
    v = prompt.issued_at_version
    samples = [common_pb2.Sample(index=i, completion=common_pb2.TokenSequence(token_ids=[5, 6], loss_mask=[True, True]),
                                 logprobs=[-0.5, -0.7], min_version=v, max_version=v, reward=float(i % 2))
               for i in range(prompt.n)]
    if malformed:
        samples[1].completion.token_ids[0] = 10**6
    group = common_pb2.TrajectoryGroup(group_id=prompt.group_id, run_id=prompt.run_id, prompt=prompt,
                                       prompt_token_ids=[1, 2], samples=samples)
    return Entry(id=f"e-{prompt.group_id}-{'bad' if malformed else 'ok'}", key=prompt.group_id, data=b""), group


def _controller(issuer: PromptIssuer, admission: Admission, timeout_s: float):
    from dataclasses import fields

    from rlmesh.learner.rl.controller import Components, Controller
    from rlmesh.services.config import load_config

    config = load_config(None, ["model.type=hf", "model.path=unused", "algorithm.max_staleness=1",
                                f"learner.reissue_malformed_after_s={timeout_s}"])
    given = {"issuer": issuer, "admission": admission, "run_id": "run"}
    parts = Components(**{f.name: given.get(f.name) for f in fields(Components)})  # the rest: None, unused
    controller = Controller(config, Path("unused"), parts)
    controller.version = 4
    return controller


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


async def test_a_malformed_copy_first_then_the_real_one_is_trained_and_no_group_is_lost(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("rlmesh.learner.rl.admission.time", clock)
    issuer, admission, prompts = await _issued_groups()
    controller = _controller(issuer, admission, timeout_s=60)
    gid = prompts[0].group_id
    assert not await admission.accept(*_answer(prompts[0], malformed=True), version=3)
    assert admission.num_dropped_invalid == 1 and admission.trajectories.acked == [f"e-{gid}-bad"]
    assert "outside the vocabulary" in admission.dropped_log.rows[0]["reason"] and issuer.ledger.in_flight == 4
    clock.now += 59
    await controller._reissue_malformed()
    assert issuer.prompts.published == [p.group_id for p in prompts], "not overdue yet: nothing issued again"
    assert await admission.accept(*_answer(prompts[0]), version=3), "the real copy is admitted"
    admission.trained(gid)
    assert admission.trained_groups == {gid} and issuer.ledger.in_flight == 3
    clock.now += 3600
    await controller._reissue_malformed()
    assert issuer.prompts.published == [p.group_id for p in prompts] and admission.num_reissued_after_invalid == 0
    # A malformed copy after it is validated and dropped with its reason; a well-formed one is a duplicate.
    assert not await admission.accept(*_answer(prompts[0], malformed=True), version=3)
    assert admission.num_dropped_invalid == 2 and "outside the vocabulary" in admission.dropped_log.rows[-1]["reason"]
    assert not await admission.accept(*_answer(prompts[0]), version=3)
    assert admission.num_duplicates == 1 and admission.malformed == {} and issuer.ledger.in_flight == 3


async def test_a_group_that_only_comes_back_malformed_is_issued_again_after_the_timeout(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("rlmesh.learner.rl.admission.time", clock)
    issuer, admission, prompts = await _issued_groups()
    issuer.ledger.unknown_in_flight = 2  # and two of an earlier process (after a restart), known by count
    controller = _controller(issuer, admission, timeout_s=60)
    old = prompts[1].group_id
    assert not await admission.accept(*_answer(prompts[1], malformed=True), version=3)
    clock.now += 30
    assert not await admission.accept(*_answer(prompts[1], malformed=True), version=3)  # the timer runs from the first
    clock.now += 31
    await controller._reissue_malformed()
    new = issuer.prompts.published[-1]
    assert issuer.prompts.published[:-1] == [p.group_id for p in prompts] and new != old
    assert admission.num_reissued_after_invalid == 1 and admission.retired == {old: new}
    assert issuer.ledger.in_flight == 6, "the new id takes the old one's place in flight"
    fresh = issuer.ledger._groups[new]
    assert fresh.issued_at_version == 4 and list(fresh.messages) == list(prompts[1].messages)
    assert new.endswith("/" + old.rsplit("/", 1)[1]), "the same example"
    await controller._reissue_malformed()
    assert admission.num_reissued_after_invalid == 1, "issued again once"
    # A late well-formed copy of the old id is dropped with its reason, never trained beside the new one.
    assert not await admission.accept(*_answer(prompts[1]), version=4)
    assert admission.dropped_log.rows[-1]["reason"].endswith(f"issued again as {new}")
    assert admission.num_dropped_other == 1 and admission.buffered == set() and issuer.ledger.in_flight == 6
    assert await admission.accept(*_answer(fresh), version=4)
    assert admission.buffered == {new} and issuer.ledger.in_flight == 5


async def test_groups_whose_every_sample_errs_stop_the_run_naming_the_reward_server():
    from rlmesh.learner.rl.watch import RunStalled, StallWatch

    admission = _admission()
    admission.watch = StallWatch(Records(), failure_limit=3, zero_signal_limit=4)
    versions = [(0, 0)] * 8
    await admission.accept(*_group("g0", versions, errors=8), version=0)
    assert await admission.accept(*_group("ok", versions), version=0)  # a signal in between resets the count
    for gid in ("g1", "g2"):
        await admission.accept(*_group(gid, versions, errors=8), version=0)
    with pytest.raises(RunStalled, match="3 prompt groups in a row failed .* reward server: 0 valid samples "
                                         r"\(errors: boom\)"):
        await admission.accept(*_group("g3", versions, errors=8), version=0)
    for gid in ("f0", "f1", "f2"):  # all equal: no signal, whether or not dynamic sampling drops them
        await admission.accept(*_group(gid, versions, rewards=[0.0] * 8), version=0)
    with pytest.raises(RunStalled, match="no reward signal: 4 groups in a row"):
        await admission.accept(*_group("f3", versions, rewards=[0.0] * 8), version=0)
