"""The learning-rate schedules: RL's constant or linear decay from `learner.lr` to `lr * lr_final_ratio`,
and SFT's constant or warm-up then cosine decay."""

import pytest

from rlmesh.learner.train.schedule import learning_rate, sft_learning_rate
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


def test_rl_warmup_ramps_up_to_either_schedule():
    config = load_config(None, ["learner.lr=1e-5", "learner.warmup_steps=4", "learner.num_steps=9"])
    rates = [learning_rate(config.learner, v) for v in range(9)]
    assert rates[:5] == pytest.approx([2.5e-6, 5e-6, 7.5e-6, 1e-5, 1e-5]) and rates[-1] == pytest.approx(1e-5)
    config.learner.lr_schedule = "linear"
    rates = [learning_rate(config.learner, v) for v in range(9)]
    assert rates[0] == pytest.approx(2.5e-6) and rates[3] == pytest.approx(1e-5 * (1 - 0.9 * 3 / 8))
    assert rates[-1] == pytest.approx(1e-6)


def test_sft_cosine_schedule_warms_up_then_decays_to_final_ratio():
    config = load_config(None, ["sft.num_steps=100", "sft.lr=1e-3", "sft.lr_schedule=cosine", "sft.warmup_steps=10",
                                "sft.lr_final_ratio=0.1"])
    rates = [sft_learning_rate(config.sft, step) for step in range(1, 101)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)  # linear warm-up to the peak
    assert all(a < b for a, b in zip(rates[:10], rates[1:10]))
    assert all(a > b for a, b in zip(rates[10:], rates[11:]))
    assert rates[-1] == pytest.approx(1e-4)  # the last step runs at lr * lr_final_ratio
    assert sft_learning_rate(config.sft, 55) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway: the mean of both ends
    config.sft.lr_schedule = "constant"
    assert sft_learning_rate(config.sft, 1) == sft_learning_rate(config.sft, 100) == 1e-3
