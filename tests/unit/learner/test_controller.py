"""Controller pieces that need no servers: the builder's config check, and admitting held-back
groups, on a controller given its components (fakes for the queues and logs)."""

from dataclasses import fields

import pytest

from rlmesh.learner.rl.controller import Components, Controller
from rlmesh.services.config import load_config


def components(**given) -> Components:
    """The parts a test hands the controller; the rest are None (the test must not reach them)."""
    return Components(**{f.name: given.get(f.name) for f in fields(Components)})


async def test_the_builder_refuses_a_model_it_cannot_load(tmp_path):
    from rlmesh.learner.rl.server import build_controller

    with pytest.raises(ValueError, match="model.type=hf"):
        await build_controller(load_config(None, []), tmp_path, 0)


async def test_groups_held_back_during_an_evaluation_are_admitted_even_when_a_batch_is_already_buffered(tmp_path):
    """They were lost before: with a full batch already buffered (k >= 2), _fill returned at once and
    dropped them, so they were never trained nor acked and counted as in flight forever."""
    from rlmesh.learner.rl.admission import Admission
    from rlmesh.learner.rl.evaluator import Evaluator
    from rlmesh.learner.rl.issuer import PromptIssuer
    from rlmesh.learner.rl.validation import Bounds
    from rlmesh.v1 import common_pb2
    from rlmesh.services.queue import Entry

    class Stream:
        def __init__(self):
            self.acked = []

        async def ack(self, *ids):
            self.acked.extend(ids)
            return len(ids)

    class Log:
        def write(self, record):
            pass

    class AllIssued:  # the ledger, with every arriving group counted as this run's
        def __init__(self, ledger):
            self.ledger = ledger

        def issued(self, group):
            return common_pb2.PromptGroup(split=group.prompt.split, n=len(group.samples))

        def issued_before_restart(self, group_id):
            return False

        def returned(self, group_id):
            self.ledger.returned(group_id)

    def arrival(i: int, version: int, split: str = "train"):
        group = common_pb2.TrajectoryGroup(group_id=f"g{i}", prompt=common_pb2.PromptGroup(group_id=f"g{i}", split=split),
                                           prompt_token_ids=[1], samples=[
            common_pb2.Sample(index=j, min_version=version, max_version=version, reward=float(j % 2)) for j in range(4)])
        return Entry(id=f"e{i}", key=f"g{i}", data=b""), group

    config = load_config(None, ["model.type=hf", "model.path=unused", "algorithm.max_staleness=2",
                                "learner.groups_per_step=4"])
    trajectories = Stream()
    issuer = PromptIssuer(Stream(), "run", [], group_size=4, groups_per_step=4, max_staleness=2)
    admission = Admission(trajectories, Log(), max_staleness=2, drop_zero_advantage_groups=False,
                          ledger=AllIssued(issuer.ledger),
                          bounds=Bounds(vocab_size=10, max_abs_reward=1e4, max_seq_len=64))
    evaluator = Evaluator([], issuer, trajectories, metrics=Log(), check=lambda group, version: "")
    controller = Controller(config, tmp_path, components(run_id="run", trajectories=trajectories, issuer=issuer,
                                                         admission=admission, evaluator=evaluator))
    controller.version = 10
    ready = [arrival(i, 9) for i in range(6)]
    controller.held_back = [arrival(i, 10) for i in range(6, 9)] + [arrival(9, 10, "eval")]
    out = await controller._fill(list(ready))
    assert sorted(g.group_id for _, g in out) == [f"g{i}" for i in range(9)]
    assert controller.held_back == [] and trajectories.acked == ["e9"]


async def test_the_first_steps_prompts_go_out_before_the_first_evaluations(tmp_path):
    """A rollout server claims prompt groups in stream order up to rollout.max_concurrent_groups: with
    the evaluation's groups first (64 in the demo, its default slot count) the first step's waited
    behind every one of them, the learner idle. After a resume (groups held back) nothing is issued
    ahead: those count against the bound first."""
    from rlmesh.learner.data.examples import Example
    from rlmesh.learner.rl.evaluator import Evaluator
    from rlmesh.learner.rl.issuer import PromptIssuer

    class Stream:  # the prompt stream, in the order groups were published
        def __init__(self):
            self.keys = []

        async def publish(self, key, data):
            self.keys.append(key)

        async def publish_many(self, records):
            self.keys.extend(key for key, _ in records)

    class Log:
        def write(self, record):
            pass

    def examples(split, n):
        return [Example(id=f"{split}{i}", messages=[{"role": "user", "content": "2+2"}], env="math",
                        metadata={"answer": "4"}) for i in range(n)]

    config = load_config(None, ["model.type=hf", "model.path=unused", "algorithm.max_staleness=1",
                                "learner.groups_per_step=3"])
    for held_back, want_train_first in (([], 6), ([("entry", "group")], 0)):
        stream = Stream()
        issuer = PromptIssuer(stream, "run", examples("t", 20), group_size=4, groups_per_step=3, max_staleness=1)
        evaluator = Evaluator(examples("e", 5), issuer, Stream(), metrics=Log(), check=lambda group, version: "")
        controller = Controller(config, tmp_path, components(run_id="run", issuer=issuer, evaluator=evaluator))
        controller.held_back = list(held_back)
        await controller._start_first_evaluation()
        splits = [key.split("/")[1] for key in stream.keys]
        assert splits == ["train"] * want_train_first + ["eval"] * 5
        assert issuer.ledger.in_flight == want_train_first  # (k + 1) * B, the bound
