"""The learning-rate schedule: constant, or linear decay from `learner.lr` to `lr * lr_final_ratio`."""

import pytest

from rlmesh.learner.train.schedule import learning_rate
from rlmesh.services.config import load_config


def test_linear_schedule_decays_from_peak_to_final_ratio():
    config = load_config(None, ["learner.lr_schedule=linear", "learner.num_steps=11", "learner.lr_final_ratio=0.1"])
    lr = config.learner.lr
    rates = [learning_rate(config.learner, v) for v in range(11)]
    assert rates[0] == pytest.approx(lr) and rates[-1] == pytest.approx(0.1 * lr)
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert learning_rate(config.learner, 20) == pytest.approx(0.1 * lr)  # past num_steps: the final rate
    config.learner.lr_schedule = "constant"
    assert learning_rate(config.learner, 5) == lr
