"""Controller pieces that need no servers: the learning-rate schedule."""

import pytest

from learner.controller import Controller
from services.config import load_config


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
