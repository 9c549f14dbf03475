"""Trajectory groups are checked before training: only groups this run issued, well formed, are
admitted; everything else is acked and written to the dropped log with its reason, and an unknown
group id changes no count. Real issuer, admission and evaluator; a recording fake for the stream."""

import math
from types import SimpleNamespace

import pytest

from rlmesh.learner.rl.admission import Admission
from rlmesh.learner.data.examples import Example
from rlmesh.learner.rl.evaluator import Evaluator
from rlmesh.learner.rl.issuer import PromptIssuer
from rlmesh.learner.rl.validation import Bounds
from rlmesh.services.queue import Entry
from rlmesh.v1 import common_pb2

VOCAB = 50
BOUNDS = Bounds(vocab_size=VOCAB, max_abs_reward=100.0, max_seq_len=32)


class FakeQueue:
    def __init__(self):
        self.published: list[tuple[str, bytes]] = []
        self.acked: list[str] = []

    async def publish(self, key, data, **_):
        self.published.append((key, data))
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


EXAMPLES = [Example(str(i), [{"role": "user", "content": f"{i}+1="}], "arithmetic", {"answer": str(i + 1)})
            for i in range(4)]


async def _setup(version: int = 2):
    issuer = PromptIssuer(FakeQueue(), "run-a", EXAMPLES, group_size=4, groups_per_step=2, max_staleness=1)
    await issuer.issue_train(num_buffered=0, version=version)  # 4 train groups issued at `version`
    admission = Admission(FakeQueue(), Records(), max_staleness=1, drop_zero_advantage_groups=False,
                          ledger=issuer.ledger, bounds=BOUNDS)
    issued = [common_pb2.PromptGroup.FromString(data) for _, data in issuer.prompts.published]
    return issuer, admission, issued


def trajectory(prompt: common_pb2.PromptGroup, version: int) -> common_pb2.TrajectoryGroup:
    """What a correct rollout server sends back for `prompt`, generated at `version`."""
    samples = [common_pb2.Sample(index=i, completion=common_pb2.TokenSequence(token_ids=[5, 6, 7],
                                                                             loss_mask=[True, True, False]),
                                 logprobs=[-0.5, -1.0, 0.0], min_version=version, max_version=version,
                                 reward=float(i % 2), finish_reason="stop")
               for i in range(prompt.n)]
    return common_pb2.TrajectoryGroup(group_id=prompt.group_id, run_id=prompt.run_id, prompt=prompt,
                                      prompt_token_ids=[1, 2, 3], samples=samples, generator_id="gen-0")


def _entry(group: common_pb2.TrajectoryGroup) -> Entry:
    return Entry(id=f"e-{group.group_id}", key=group.group_id, data=b"")


async def test_a_well_formed_issued_group_is_admitted_and_counted_back():
    issuer, admission, issued = await _setup()
    assert issuer.ledger.in_flight == 4
    assert await admission.accept(_entry(g := trajectory(issued[0], 2)), g, version=2)
    assert issuer.ledger.in_flight == 3 and admission.num_dropped_invalid == 0 and admission.dropped_log.rows == []


async def test_an_unknown_group_id_is_dropped_and_changes_no_count():
    issuer, admission, issued = await _setup()
    issuer.ledger.unknown_in_flight = 3  # after a restart: counted, but the forged id is not an earlier process's
    forged = trajectory(issued[0], 2)
    forged.group_id = forged.prompt.group_id = "run-a/train/999/x"
    assert not await admission.accept(_entry(forged), forged, version=2)
    assert issuer.ledger.in_flight == 7 and admission.num_dropped_invalid == 1
    assert admission.trajectories.acked == ["e-run-a/train/999/x"]
    row = admission.dropped_log.rows[0]
    assert row["group_id"] == "run-a/train/999/x" and "not issued by this run" in row["reason"]


async def test_a_well_formed_copy_of_a_group_already_back_is_a_duplicate_and_changes_no_count():
    issuer, admission, issued = await _setup()
    group = trajectory(issued[0], 2)
    group.samples[0].reward = group.samples[1].reward = group.samples[2].reward = group.samples[3].reward = 1.0
    admission.drop_flat = True
    assert not await admission.accept(_entry(group), group, version=2)  # dropped (flat), and back
    assert not await admission.accept(_entry(group), group, version=2)
    assert issuer.ledger.in_flight == 3 and admission.num_duplicates == 1 and len(admission.dropped_log.rows) == 1



CASES = {
    "run id": (lambda g: setattr(g, "run_id", "someone-else"), "run id"),
    "prompt group id": (lambda g: setattr(g.prompt, "group_id", "other"), "prompt group id"),
    "split": (lambda g: setattr(g.prompt, "split", "eval"), "split 'eval' but issued as 'train'"),
    "too few samples": (lambda g: g.samples.pop(), "3 samples, issued for 4"),
    "too many samples": (lambda g: g.samples.add().CopyFrom(g.samples[0]), "5 samples, issued for 4"),
    "mask longer than tokens": (lambda g: g.samples[1].completion.loss_mask.extend([True] * 6),
                                "3 completion tokens but 9 loss-mask entries"),
    "logprobs shorter": (lambda g: g.samples[1].logprobs.pop(), "2 logprobs"),
    "negative token id": (lambda g: g.samples[0].completion.token_ids.__setitem__(0, -5), "token id -5 outside"),
    "huge token id": (lambda g: g.samples[0].completion.token_ids.__setitem__(0, 2_000_000_000), "2000000000 outside"),
    "token id == vocab": (lambda g: g.samples[0].completion.token_ids.__setitem__(0, VOCAB), f"{VOCAB} outside"),
    "prompt token id": (lambda g: g.prompt_token_ids.append(-1), "prompt token id -1"),
    "no prompt tokens": (lambda g: g.ClearField("prompt_token_ids"), "no prompt tokens"),
    "too long": (lambda g: [g.samples[0].completion.token_ids.extend([1] * 40), g.samples[0].completion.loss_mask.extend(
        [True] * 40), g.samples[0].logprobs.extend([-1.0] * 40)], "exceed the context length 32"),
    "nan logprob": (lambda g: g.samples[2].logprobs.__setitem__(0, math.nan), "logprob nan"),
    "-inf logprob": (lambda g: g.samples[2].logprobs.__setitem__(0, -math.inf), "logprob -inf"),
    "positive logprob": (lambda g: g.samples[2].logprobs.__setitem__(0, 0.5), "logprob 0.5"),
    "nan reward": (lambda g: setattr(g.samples[3], "reward", math.nan), "reward nan"),
    "inf reward": (lambda g: setattr(g.samples[3], "reward", math.inf), "reward inf"),
    "huge reward": (lambda g: setattr(g.samples[3], "reward", 3e38), "beyond +/-100 (reward.max_abs_reward)"),
    "nan component": (lambda g: g.samples[3].reward_components.__setitem__("correct", math.nan), "component 'correct'"),
    "nan turn reward": (lambda g: g.samples[1].turns.add(start=0, num_sampled_tokens=1, reward=math.nan),
                        "turn 0 reward nan"),
    "turn past the completion": (lambda g: g.samples[1].turns.add(start=2, num_sampled_tokens=5),
                                 "turn 0 spans completion tokens 2..7, outside its 3"),
    "older than issued": (lambda g: setattr(g.samples[0], "min_version", 1), "versions 1..2"),
    "min above max": (lambda g: setattr(g.samples[0], "min_version", 3), "versions 3..2"),
    "negative version": (lambda g: [setattr(g.samples[0], "min_version", -7)], "versions -7..2"),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_malformed_group_is_dropped_with_its_reason_and_acked_and_its_id_stays_outstanding(case):
    mutate, reason = CASES[case]
    issuer, admission, issued = await _setup()
    group = trajectory(issued[0], 2)
    mutate(group)
    assert not await admission.accept(_entry(group), group, version=2)
    assert admission.num_dropped_invalid == 1 and admission.trajectories.acked == [f"e-{issued[0].group_id}"]
    row = admission.dropped_log.rows[0]
    assert reason in row["reason"], row
    assert row["group_id"] == issued[0].group_id
    # Still in flight: the rollout server's well-formed copy is still to come, and is admitted.
    assert issuer.ledger.in_flight == 4
    assert await admission.accept(_entry(real := trajectory(issued[0], 2)), real, version=2)
    assert issuer.ledger.in_flight == 3 and admission.num_dropped_invalid == 1
    # A malformed copy arriving after it is validated too, and dropped with the same reason.
    assert not await admission.accept(_entry(group), group, version=2)
    assert admission.num_dropped_invalid == 2 and reason in admission.dropped_log.rows[-1]["reason"]
    assert admission.buffered == {issued[0].group_id} and admission.num_duplicates == 0


async def test_a_failed_sample_is_not_checked_it_is_never_trained():
    issuer, admission, issued = await _setup()
    group = trajectory(issued[0], 2)
    group.samples[0].error = "env_error: boom"
    group.samples[0].reward = math.nan
    group.samples[0].ClearField("logprobs")
    assert await admission.accept(_entry(group), group, version=2)


async def test_a_group_whose_every_episode_failed_before_its_prompt_is_a_failed_group_not_a_malformed_one():
    """Episodes whose reset failed have no prompt to share: the group comes back with no prompt tokens,
    and counts as failed (the stall watch sees it), instead of waiting for a copy that never comes."""
    from rlmesh.learner.rl.watch import RunStalled, StallWatch

    issuer, admission, issued = await _setup()
    admission.watch = StallWatch(Records(), failure_limit=2)
    for i, prompt in enumerate(issued[:2]):
        group = trajectory(prompt, 2)
        group.ClearField("prompt_token_ids")
        for sample in group.samples:
            sample.error = "env_error: environment 'calc': the reset on the reward tier failed: UNAVAILABLE: gone"
        if i == 0:
            assert not await admission.accept(_entry(group), group, version=2)
        else:
            with pytest.raises(RunStalled, match="reward server: 0 valid samples .*the reset on the reward tier failed"):
                await admission.accept(_entry(group), group, version=2)
    assert admission.num_dropped_invalid == 0 and not admission.malformed and issuer.ledger.in_flight == 2


async def _restarted(num_in_flight: int):
    """run-a's groups, then a learner restarted as run-b with `num_in_flight` of them still out;
    run-b tops the train groups up to its bound."""
    _, _, old_issued = await _setup()
    issuer = PromptIssuer(FakeQueue(), "run-b", EXAMPLES, group_size=4, groups_per_step=2, max_staleness=1)
    issuer.ledger.earlier_run_ids, issuer.ledger.unknown_in_flight = {"run-a"}, num_in_flight
    await issuer.issue_train(num_buffered=0, version=2)
    admission = Admission(FakeQueue(), Records(), max_staleness=1, drop_zero_advantage_groups=False,
                          ledger=issuer.ledger, bounds=BOUNDS)
    issued = [common_pb2.PromptGroup.FromString(data) for _, data in issuer.prompts.published]
    return issuer, admission, old_issued, issued


async def test_weights_newer_than_the_learner_keep_their_restart_reason_only_for_an_earlier_process():
    issuer, admission, old_issued, issued = await _restarted(num_in_flight=2)
    assert issuer.ledger.in_flight == 4 and len(issued) == 2
    leftover = trajectory(old_issued[0], 5)  # by weights the restart lost: dropped, and back
    assert not await admission.accept(_entry(leftover), leftover, version=2)
    assert admission.num_dropped_other == 1 and admission.num_dropped_invalid == 0
    assert "newer than the learner" in admission.dropped_log.rows[-1]["reason"] and issuer.ledger.in_flight == 3
    # One this process issued cannot be (its generators were brought to the learner's weights first):
    # a malformed copy, and the id stays outstanding.
    mine = trajectory(issued[0], 5)
    assert not await admission.accept(_entry(mine), mine, version=2)
    assert admission.num_dropped_invalid == 1 and "versions 5..5" in admission.dropped_log.rows[-1]["reason"]
    assert issuer.ledger.in_flight == 3 and list(admission.malformed) == [issued[0].group_id]


async def test_groups_of_an_earlier_process_of_this_run_are_accepted_once_after_a_restart():
    issuer, admission, old_issued, _ = await _restarted(num_in_flight=4)
    group = trajectory(old_issued[0], 2)
    assert await admission.accept(_entry(group), group, version=2)
    assert issuer.ledger.in_flight == 3
    admission.trained(group.group_id)
    assert not await admission.accept(_entry(group), group, version=2)
    assert admission.num_duplicates == 1 and issuer.ledger.in_flight == 3
    wrong_size = trajectory(old_issued[1], 2)
    wrong_size.samples.pop()
    assert not await admission.accept(_entry(wrong_size), wrong_size, version=2)
    assert "3 samples, issued for 4" in admission.dropped_log.rows[-1]["reason"] and issuer.ledger.in_flight == 3
    again = trajectory(old_issued[1], 2)  # the real copy, after the malformed one
    assert await admission.accept(_entry(again), again, version=2)
    assert issuer.ledger.in_flight == 2 and admission.num_dropped_invalid == 1


async def test_an_eval_group_with_no_samples_is_a_failed_answer_not_a_crash():
    issuer, admission, _ = await _setup()
    records = []
    evaluator = Evaluator(EXAMPLES[:2], issuer, admission.trajectories,
                          metrics=SimpleNamespace(write=records.append), check=admission.check)
    await evaluator.start(2)
    eval_groups = [common_pb2.PromptGroup.FromString(d) for _, d in issuer.prompts.published[-2:]]
    empty = trajectory(eval_groups[0], 2)
    empty.ClearField("samples")
    good = trajectory(eval_groups[1], 2)
    good.samples[0].reward = 1.0
    forged = trajectory(eval_groups[1], 2)
    forged.group_id = forged.prompt.group_id = "run-a/eval/77/x"
    assert await evaluator.offer(_entry(forged), forged, 2) is None  # no round of its own: only acked
    assert await evaluator.offer(_entry(empty), empty, 2) is None
    record = await evaluator.offer(_entry(good), good, 2)
    assert record is not None and record["num_prompts"] == 2 and record["num_errors"] == 1
    assert record["accuracy"] == 0.5
    assert "0 samples, issued for 1" in admission.dropped_log.rows[-1]["reason"]
    assert issuer.ledger.in_flight == 4, "eval groups never count as train groups in flight"


async def test_an_entry_that_is_no_trajectory_group_is_dropped_on_record():
    _, admission, _ = await _setup()
    await admission.drop_undecodable(Entry(id="e-x", key="garbage", data=b"\xff"), ValueError("bad wire type"))
    assert admission.trajectories.acked == ["e-x"] and admission.num_dropped_invalid == 1
    assert admission.dropped_log.rows == [{"entry_id": "e-x", "group_id": "garbage", "invalid": True,
                                           "reason": "not a TrajectoryGroup (bad wire type)"}]
