"""What the learner does with arrivals while a training step runs (`TrajectoryReader.admit_during`):
train groups are admitted into the buffer at the step's version, evaluation groups are held back
for the next fill, an undecodable entry is dropped, and it returns once the step is done. Real
issuer and admission; a fake stream that hands out what a test put in it."""

from __future__ import annotations

import asyncio

from rlmesh.learner.rl.admission import Admission
from rlmesh.learner.data.examples import Example
from rlmesh.learner.rl.issuer import PromptIssuer
from rlmesh.learner.rl.reader import TrajectoryReader
from rlmesh.learner.rl.validation import Bounds
from rlmesh.services.queue import Entry
from rlmesh.v1 import common_pb2


class Stream:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.waiting: list[Entry] = []
        self.acked: list[str] = []
        self.num_reads = 0

    async def publish(self, key, data, **_):
        self.published.append((key, data))
        return key

    async def publish_many(self, items, **_):
        return len([await self.publish(key, data) for key, data in items])

    async def read(self, consumer, *, count, block_ms):
        self.num_reads += 1
        out, self.waiting = self.waiting[:count], self.waiting[count:]
        if not out:
            await asyncio.sleep(block_ms / 1000)
        return out

    async def ack(self, *ids):
        self.acked.extend(ids)
        return len(ids)


class Records:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, record: dict) -> None:
        self.rows.append(record)


def returned(prompt: common_pb2.PromptGroup, version: int) -> common_pb2.TrajectoryGroup:
    samples = [common_pb2.Sample(index=i, completion=common_pb2.TokenSequence(token_ids=[3, 4], loss_mask=[1, 1]),
                                 logprobs=[-0.1, -0.2], reward=float(i % 2), min_version=version, max_version=version)
               for i in range(prompt.n)]
    return common_pb2.TrajectoryGroup(group_id=prompt.group_id, run_id=prompt.run_id, prompt=prompt,
                                      prompt_token_ids=[1, 2], samples=samples, generator_id="gen")


async def test_arrivals_during_a_training_step_are_admitted_or_held_back_until_it_ends():
    prompts, trajectories, dropped = Stream(), Stream(), Records()
    examples = [Example(str(i), [{"role": "user", "content": f"{i}?"}], "arithmetic", {"answer": "1"}) for i in range(8)]
    issuer = PromptIssuer(prompts, "run", examples, group_size=2, groups_per_step=2, max_staleness=1)
    assert await issuer.issue_train(0, version=3) == 4
    admission = Admission(trajectories, dropped, max_staleness=1, drop_zero_advantage_groups=False,
                          ledger=issuer.ledger, bounds=Bounds(vocab_size=10, max_abs_reward=5, max_seq_len=16))
    reader = TrajectoryReader(prompts, trajectories, run_id="run", issuer=issuer, admission=admission,
                              membership=None, metrics=None)
    issued = [common_pb2.PromptGroup.FromString(data) for _, data in prompts.published]
    evaluation = issuer.prompt_group(examples[7], "eval", 1, 3, greedy=True)
    await issuer.publish(evaluation)
    arriving = [returned(g, 3) for g in issued[:3]] + [returned(evaluation, 3)]
    entries = [Entry(f"e{i}", g.group_id, g.SerializeToString()) for i, g in enumerate(arriving)]
    entries.append(Entry("junk", "junk", b"\xff\xfe not a group"))

    step_done = asyncio.Event()

    async def training_step() -> None:
        await asyncio.sleep(0.1)  # nothing has arrived yet
        trajectories.waiting.extend(entries)
        await step_done.wait()

    step = asyncio.ensure_future(training_step())
    ready, held_back = [], []
    admitting = asyncio.ensure_future(reader.admit_during(step, 3, ready, held_back))
    while trajectories.waiting or not ready:
        await asyncio.sleep(0.01)
    assert not admitting.done()  # the step still runs: so does admission
    step_done.set()
    await asyncio.wait_for(admitting, 1.0)
    assert [g.group_id for _, g in ready] == [g.group_id for g in issued[:3]]
    assert [g.group_id for _, g in held_back] == [evaluation.group_id]  # for the evaluator, at the next fill
    assert trajectories.acked == ["junk"] and admission.num_dropped_invalid == 1
    assert issuer.ledger.in_flight == 1  # three back, one still out


async def _step_with_arrivals(flat: list[bool]) -> tuple[PromptIssuer, list]:
    """k=1, two groups a step: four issued, the first two form the batch in training, the other two
    arrive during the step (all rewards equal where `flat` says so; dynamic sampling on). The
    refill is the controller's: issue at this version, the step's own batch counted as buffered."""
    prompts, trajectories = Stream(), Stream()
    examples = [Example(str(i), [{"role": "user", "content": f"{i}?"}], "arithmetic", {"answer": "1"}) for i in range(8)]
    issuer = PromptIssuer(prompts, "run", examples, group_size=2, groups_per_step=2, max_staleness=1)
    assert await issuer.issue_train(0, version=3) == 4
    admission = Admission(trajectories, Records(), max_staleness=1, drop_zero_advantage_groups=True,
                          ledger=issuer.ledger, bounds=Bounds(vocab_size=10, max_abs_reward=5, max_seq_len=16))
    reader = TrajectoryReader(prompts, trajectories, run_id="run", issuer=issuer, admission=admission,
                              membership=None, metrics=None)
    issued = [common_pb2.PromptGroup.FromString(data) for _, data in prompts.published]
    for g in issued[:2]:  # the batch now in training
        issuer.ledger.returned(g.group_id)
    arriving = []
    for g, is_flat in zip(issued[2:], flat):
        group = returned(g, 3)
        if is_flat:
            for s in group.samples:
                s.reward = 0.0
        arriving.append(Entry(g.group_id, g.group_id, group.SerializeToString()))
    trajectories.waiting.extend(arriving)
    refills = []

    async def refill(num_ready: int) -> None:
        refills.append(num_ready)
        await issuer.issue_train(num_ready + 2, 3)

    step_done = asyncio.Event()
    step = asyncio.ensure_future(step_done.wait())
    ready: list = []
    admitting = asyncio.ensure_future(reader.admit_during(step, 3, ready, [], refill=refill))
    while trajectories.waiting:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    step_done.set()
    await asyncio.wait_for(admitting, 1.0)
    return issuer, refills


async def test_a_group_dropped_during_a_step_is_replaced_at_once_within_the_bound():
    issuer, refills = await _step_with_arrivals([False, True])
    assert refills == [1]  # one admitted, one dropped as all-equal
    assert issuer.num_issued == 5 and issuer.ledger.in_flight == 1  # its replacement is out: 2 + 1 + 1 <= (k+1) * 2
    issuer, refills = await _step_with_arrivals([False, False])
    assert refills == [] and issuer.num_issued == 4 and issuer.ledger.in_flight == 0  # nothing dropped, nothing issued
