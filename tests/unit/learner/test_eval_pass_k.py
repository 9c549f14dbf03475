"""pass@k in the learner's held-out evaluations (learner.eval_pass_k): each prompt gets a greedy
answer and n sampled ones; the record keeps greedy accuracy as before and adds pass@k per
environment and over every prompt, by the unbiased estimator."""

import asyncio
from types import SimpleNamespace

import pytest

from rlmesh.learner.rl.ledger import Ledger
from rlmesh.services.domain.pass_at_k import pass_at_k
from rlmesh.learner.data.examples import Example
from rlmesh.learner.rl.evaluator import Evaluator
from rlmesh.services.config import load_config
from rlmesh.v1 import common_pb2


def _sample(correct: float, error: str = "") -> common_pb2.Sample:
    s = common_pb2.Sample(reward=correct, finish_reason="stop", error=error)
    s.reward_components["correct"] = correct
    return s


# prompt id -> (environment, greedy verdict, verdicts of the n = 4 sampled completions)
ANSWERS = {"a": ("math", 1.0, [1, 0, 0, 0]), "b": ("math", 0.0, [0, 0, 0, 0]),
           "c": ("arithmetic", 0.0, [1, 1, 0, 1]), "d": ("arithmetic", 1.0, [1, 1, 1, 1])}


class Issuer:
    def __init__(self):
        self.published = []

    def prompt_group(self, ex, split, n, version, greedy):
        group = common_pb2.TrajectoryGroup(group_id=f"{ex.id}/{len(self.published)}",
                                           prompt=common_pb2.PromptGroup(split=split, env_name=ex.env, n=n))
        env, first, sampled = ANSWERS[ex.id]
        assert greedy == (n == 1)
        group.samples.extend([_sample(first)] if greedy else [_sample(float(v)) for v in sampled])
        return group

    async def publish(self, group):
        self.published.append(group)

    ledger = Ledger(1)  # the groups it hands out are never recorded: evaluation strikes off nothing


def test_records_pass_at_k_per_environment_beside_greedy_accuracy():
    issuer, written = Issuer(), []

    async def ack(entry_id):
        pass

    async def read(version):
        out, issuer.published[:] = [(SimpleNamespace(id=g.group_id), g) for g in issuer.published], []
        return out

    examples = [Example(id=i, messages=[{"role": "user", "content": i}], env=env) for i, (env, _, _) in ANSWERS.items()]
    evaluator = Evaluator(examples, issuer, SimpleNamespace(ack=ack),
                          SimpleNamespace(write=written.append), check=lambda group, version: "",
                          pass_k=[1, 2, 4], num_samples=4)
    record = asyncio.run(evaluator.run(0, [], read))
    assert written == [record] and not evaluator.rounds and not evaluator.sampled_ids
    assert record["accuracy"] == 0.5 and record["num_prompts"] == 4  # greedy answers only
    assert record["accuracy_by_env"] == {"arithmetic": 0.5, "math": 0.5}
    for k in (1, 2, 4):
        math = (pass_at_k(4, 1, k) + pass_at_k(4, 0, k)) / 2
        arith = (pass_at_k(4, 3, k) + pass_at_k(4, 4, k)) / 2
        assert record["pass_at_k"]["math"][str(k)] == pytest.approx(math)
        assert record["pass_at_k"]["arithmetic"][str(k)] == pytest.approx(arith)
        assert record[f"pass@{k}"] == pytest.approx((math + arith) / 2)
    assert record["pass@1"] == pytest.approx(0.5) and record["pass@4"] == pytest.approx(0.75)


def test_pass_k_config_is_checked_against_the_number_of_samples():
    assert load_config(None, ["learner.eval_pass_k=[1,4,8]"]).learner.eval_pass_k == [1, 4, 8]
    with pytest.raises(ValueError, match=r"eval_pass_k=\[1, 8\]: every k must be in \[1, eval_num_samples=4\]"):
        load_config(None, ["learner.eval_pass_k=[1,8]", "learner.eval_num_samples=4"])
