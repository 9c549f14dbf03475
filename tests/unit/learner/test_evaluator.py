"""Held-out accuracy accounting: the environment's `correct` verdict where it gives one; an episode
cut off by the turn budget counts as wrong instead of switching the record to mean reward."""

import asyncio
from types import SimpleNamespace

from rlmesh.learner.rl.ledger import Ledger
from rlmesh.learner.data.examples import Example
from rlmesh.learner.rl.evaluator import Evaluator
from rlmesh.v1 import common_pb2


def sample(reward: float, finish: str, correct: float | None = None, error: str = "") -> common_pb2.Sample:
    s = common_pb2.Sample(reward=reward, finish_reason=finish, error=error)
    if correct is not None:
        s.reward_components["correct"] = correct
    return s


EXAMPLE = Example(id="e", messages=[{"role": "user", "content": "p"}], env="calculator")


class Issuer:
    """Hands out eval groups and remembers them so the read below can answer each."""

    def __init__(self, samples):
        self.samples, self.published = list(samples), []

    def prompt_group(self, ex, split, n, version, greedy):
        return common_pb2.TrajectoryGroup(group_id=f"g{len(self.published)}",
                                          prompt=common_pb2.PromptGroup(split=split))

    async def publish(self, group):
        group.samples.append(self.samples[len(self.published)])
        self.published.append(group)

    ledger = Ledger(1)  # the groups it hands out are never recorded: evaluation strikes off nothing


def evaluate(samples) -> dict:
    issuer = Issuer(samples)
    acked = []

    async def ack(entry_id):
        acked.append(entry_id)

    async def read(version):
        assert version == 3
        out, issuer.published[:] = [(SimpleNamespace(id=g.group_id), g) for g in issuer.published], []
        return out

    written = []
    evaluator = Evaluator([EXAMPLE] * len(samples), issuer, SimpleNamespace(ack=ack),
                          SimpleNamespace(write=written.append), check=lambda group, version: "")
    record = asyncio.run(evaluator.run(3, [], read))
    assert sorted(acked) == sorted(f"g{i}" for i in range(len(samples)))
    assert written == [record] and not evaluator.rounds
    return record


def test_an_episode_cut_off_at_max_turns_counts_as_wrong_not_as_mean_reward():
    record = evaluate([sample(1.0, "done", 1.0), sample(0.2, "done", 0.0), sample(0.5, "max_turns"),
                       sample(1.0, "done", 1.0)])
    assert record["accuracy_source"] == "env_correct"
    assert record["accuracy"] == 0.5


def test_without_a_verdict_accuracy_is_the_mean_reward_and_errors_count_as_zero():
    record = evaluate([sample(0.5, "stop"), sample(1.0, "stop"), sample(0.0, "stop", error="env_error: boom"),
                       sample(0.5, "stop")])
    assert record["accuracy_source"] == "mean_reward"
    assert record["accuracy"] == 0.5 and record["num_errors"] == 1


def test_episodes_all_cut_off_give_no_verdict():
    record = evaluate([sample(0.25, "max_turns"), sample(0.75, "max_turns")])
    assert record["accuracy_source"] == "mean_reward" and record["accuracy"] == 0.5


def test_a_round_started_beside_training_finishes_when_its_last_group_is_offered():
    """learner.eval_overlap: the controller offers eval groups it reads while filling a batch."""
    issuer = Issuer([sample(1.0, "done", 1.0), sample(0.0, "done", 0.0)])
    acked, written = [], []

    async def ack(entry_id):
        acked.append(entry_id)

    evaluator = Evaluator([EXAMPLE] * 2, issuer, SimpleNamespace(ack=ack),
                          SimpleNamespace(write=written.append), check=lambda group, version: "")

    async def scenario():
        await evaluator.start(7)
        first, second = issuer.published
        for g in (first, second):  # answered by a newer policy than the round's
            g.samples[0].min_version = g.samples[0].max_version = 8
        stray = common_pb2.TrajectoryGroup(group_id="old/eval/1", prompt=common_pb2.PromptGroup(split="eval"))
        assert await evaluator.offer(SimpleNamespace(id="s"), stray, 8) is None
        assert await evaluator.offer(SimpleNamespace(id="a"), first, 8) is None and written == []
        return await evaluator.offer(SimpleNamespace(id="b"), second, 8)

    record = asyncio.run(scenario())
    assert written == [record] and not evaluator.rounds and acked == ["s", "a", "b"]
    assert record["version"] == 7 and record["generated_at_versions"] == [8, 8] and record["accuracy"] == 0.5


def test_finishing_offers_the_eval_groups_held_back_during_a_step_and_keeps_the_train_ones():
    """An eval group read while a step trained waits in `held_back`: waiting for its round offers it
    (else the wait would read on until its timeout); train groups stay held back for the next fill."""
    issuer = Issuer([sample(1.0, "done", 1.0), sample(0.0, "done", 0.0)])
    evaluator = Evaluator([EXAMPLE] * 2, issuer, SimpleNamespace(ack=lambda entry_id: asyncio.sleep(0)),
                          SimpleNamespace(write=lambda record: None), check=lambda group, version: "", timeout_s=2.0)
    train = common_pb2.TrajectoryGroup(group_id="t", prompt=common_pb2.PromptGroup(split="train"))
    reads = []

    async def read(version):
        reads.append(version)
        late = issuer.published[1:]
        issuer.published[1:] = []
        return [(SimpleNamespace(id=g.group_id), g) for g in late] + [(SimpleNamespace(id="t2"), train)]

    async def scenario():
        rnd = await evaluator.start(0)
        held_back = [(SimpleNamespace(id="t1"), train), (SimpleNamespace(id="g0"), issuer.published[0])]
        await evaluator.finish(0, held_back, read, rnd)
        return rnd, held_back

    rnd, held_back = asyncio.run(scenario())
    assert rnd.record["accuracy"] == 0.5 and not evaluator.rounds
    assert reads == [0]  # one read brought the last answer
    assert [e.id for e, _ in held_back] == ["t1", "t2"]


def test_a_failed_answer_adds_no_versions_to_the_round():
    """A dropped eval group (here: one the learner's validation refuses) is an error of the round and
    carries no versions: the round's generated_at_versions are its answers' alone."""
    issuer = Issuer([sample(1.0, "done", 1.0), sample(0.0, "done", 0.0)])
    written, refused = [], []
    evaluator = Evaluator([EXAMPLE] * 2, issuer, SimpleNamespace(ack=lambda entry_id: asyncio.sleep(0)),
                          SimpleNamespace(write=written.append),
                          check=lambda group, version: "0 samples, issued for 1" if group in refused else "")

    async def scenario():
        await evaluator.start(10)
        good, bad = issuer.published
        refused.append(bad)
        good.samples[0].min_version = good.samples[0].max_version = 10
        assert await evaluator.offer(SimpleNamespace(id="a"), good, 10) is None
        return await evaluator.offer(SimpleNamespace(id="b"), bad, 10)

    record = asyncio.run(scenario())
    assert record["num_errors"] == 1 and record["generated_at_versions"] == [10, 10], record


def test_the_first_answers_of_each_round_are_written_in_eval_set_order():
    """logging.eval_samples: the first N greedy answers of a round (by the eval set's order, whatever
    order they come back in), with the prompt's text, the completion's text and the verdict."""
    answers = [sample(1.0, "stop", 1.0), sample(0.0, "length", 0.0), sample(1.0, "stop", 1.0)]
    for i, s in enumerate(answers):
        s.text = f"answer {i}"
        s.completion.token_ids.extend(range(i + 2))
    issuer = Issuer(answers)

    def prompt_group(ex, split, n, version, greedy):
        msg = common_pb2.ChatMessage(role="user", content=f"question {len(issuer.published)}")
        return common_pb2.TrajectoryGroup(group_id=f"g{len(issuer.published)}", prompt=common_pb2.PromptGroup(
            split=split, env_name="math", messages=[msg]))

    issuer.prompt_group = prompt_group

    async def read(version):
        out, issuer.published[:] = [(SimpleNamespace(id=g.group_id), g) for g in reversed(issuer.published)], []
        return out

    metrics, rows = [], []
    evaluator = Evaluator([EXAMPLE] * 3, issuer, SimpleNamespace(ack=lambda entry_id: asyncio.sleep(0)),
                          SimpleNamespace(write=metrics.append), check=lambda group, version: "",
                          samples=SimpleNamespace(write=rows.append), samples_per_round=2)
    record = asyncio.run(evaluator.run(4, [], read))
    assert record["accuracy"] == 2 / 3 and metrics == [record]
    assert [(r["prompt"], r["completion"], r["correct"], r["finish_reason"], r["num_tokens"]) for r in rows] == [
        ("question 0", "answer 0", True, "stop", 2), ("question 1", "answer 1", False, "length", 3)]
    assert all(r["version"] == 4 and r["env"] == "math" and r["kind"] == "eval_sample" for r in rows)
