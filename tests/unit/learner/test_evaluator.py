"""Held-out accuracy accounting: the environment's `correct` verdict where it gives one; an episode
cut off by the turn budget counts as wrong instead of switching the record to mean reward."""

import asyncio
from types import SimpleNamespace

from learner.data import Example
from learner.evaluator import Evaluator
from rlmesh.v1 import common_pb2


def sample(reward: float, finish: str, correct: float | None = None, error: str = "") -> common_pb2.Sample:
    s = common_pb2.Sample(reward=reward, finish_reason=finish, error=error)
    if correct is not None:
        s.reward_components["correct"] = correct
    return s


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

    def returned(self, group_id):
        pass


def evaluate(samples) -> dict:
    issuer = Issuer(samples)
    acked = []

    async def ack(entry_id):
        acked.append(entry_id)

    async def read():
        out, issuer.published[:] = [(SimpleNamespace(id=g.group_id), g) for g in issuer.published], []
        return out

    async def idle():
        pass

    evaluator = Evaluator([Example(id="e", messages=[{"role": "user", "content": "p"}], env="calculator")] * len(samples), issuer,
                          SimpleNamespace(ack=ack), read, idle)
    record = asyncio.run(evaluator.run(3, []))
    assert sorted(acked) == sorted(f"g{i}" for i in range(len(samples)))
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
