"""Controller pieces that need no servers: the learning-rate schedule, and admitting held-back groups."""

import pytest

from rlmesh.learner.controller import Controller
from rlmesh.services.config import load_config


def test_linear_schedule_decays_from_peak_to_final_ratio(tmp_path):
    config = load_config(None, ["model.type=hf", "model.path=unused", "learner.lr_schedule=linear",
                                "learner.num_steps=11", "learner.lr_final_ratio=0.1"])
    controller = Controller(config, tmp_path)
    lr = config.learner.lr
    rates = []
    for v in range(11):
        controller.version = v
        rates.append(controller.learning_rate())
    assert rates[0] == pytest.approx(lr) and rates[-1] == pytest.approx(0.1 * lr)
    assert all(a > b for a, b in zip(rates, rates[1:]))
    config.learner.lr_schedule = "constant"
    assert controller.learning_rate() == lr


def test_controller_refuses_a_model_it_cannot_load(tmp_path):
    with pytest.raises(ValueError, match="model.type=hf"):
        Controller(load_config(None, []), tmp_path)


async def test_groups_held_back_during_an_evaluation_are_admitted_even_when_a_batch_is_already_buffered(tmp_path):
    """They were lost before: with a full batch already buffered (k >= 2), _fill returned at once and
    dropped them, so they were never trained nor acked and counted as in flight forever."""
    from rlmesh.learner.admission import Admission
    from rlmesh.learner.evaluator import Evaluator
    from rlmesh.learner.issuer import PromptIssuer
    from rlmesh.learner.validation import Bounds
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

    def arrival(i: int, version: int, split: str = "train"):
        group = common_pb2.TrajectoryGroup(group_id=f"g{i}", prompt=common_pb2.PromptGroup(group_id=f"g{i}", split=split),
                                           prompt_token_ids=[1], samples=[
            common_pb2.Sample(index=j, min_version=version, max_version=version, reward=float(j % 2)) for j in range(4)])
        return Entry(id=f"e{i}", key=f"g{i}", data=b""), group

    config = load_config(None, ["model.type=hf", "model.path=unused", "algorithm.max_staleness=2",
                                "learner.groups_per_step=4"])
    controller = Controller(config, tmp_path)
    controller.version = 10
    controller.trajectories = Stream()
    controller.issuer = PromptIssuer(Stream(), "run", [], group_size=4, groups_per_step=4, max_staleness=2)
    controller.admission = Admission(controller.trajectories, Log(), max_staleness=2,
                                     drop_zero_advantage_groups=False, on_returned=controller.issuer.returned,
                                     issued=lambda g: common_pb2.PromptGroup(split=g.prompt.split, n=len(g.samples)),
                                     bounds=Bounds(vocab_size=10, max_abs_reward=1e4, max_seq_len=64))
    controller.evaluator = Evaluator([], controller.issuer, controller.trajectories, None, None, Log().write,
                                     check=lambda group: "")
    ready = [arrival(i, 9) for i in range(6)]
    controller.held_back = [arrival(i, 10) for i in range(6, 9)] + [arrival(9, 10, "eval")]
    out = await controller._fill(list(ready))
    assert sorted(g.group_id for _, g in out) == [f"g{i}" for i in range(9)]
    assert controller.held_back == [] and controller.trajectories.acked == ["e9"]
