"""KL penalty to the frozen starting policy: the estimators against hand-computed values, the
reward-side reshaping, and the real FSDP2 learner step with `algorithm.kl` in the loss and in the
reward (the reference equals the policy before training, and kl_ref grows once it moves)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rlmesh.learner.train.algorithms.kl import kl_estimate  # noqa: E402

from tests.unit.learner.test_baseline import fixed_groups, make_trainer  # noqa: E402


def test_estimators_by_hand():
    # d = log pi - log pi_ref = 0.5 and -0.3.
    logprobs = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.7])
    assert kl_estimate(logprobs, ref, "k1").tolist() == pytest.approx([0.5, -0.3])
    assert kl_estimate(logprobs, ref, "k2").tolist() == pytest.approx([0.125, 0.045])
    assert kl_estimate(logprobs, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5,
                                                                      math.exp(0.3) - 1 - 0.3])
    assert kl_estimate(ref, ref, "k3").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="algorithm.kl.estimator"):
        kl_estimate(logprobs, ref, "k4")


def test_k3_gradient_pulls_towards_the_reference():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    kl_estimate(logprobs, torch.tensor([-1.5, -1.7]), "k3").sum().backward()
    # d/dx (exp(-d) - 1 + d) = 1 - exp(-d): positive where pi > pi_ref, negative where below.
    assert logprobs.grad.tolist() == pytest.approx([1 - math.exp(-0.5), 1 - math.exp(0.3)])


def test_megatron_refuses_kl_naming_what_is_missing():
    from rlmesh.services.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match="reference model"):
        load_config(None, ["algorithm.kl.coef=0.1", "learner.backend.type=megatron"])


def test_top_p_below_one_is_refused_naming_the_bias():
    from rlmesh.services.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match="truncated"):
        load_config(None, ["rollout.top_p=0.9"])


def test_kl_in_the_loss_through_the_fsdp2_learner(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, 12, "algorithm.kl.coef=0.5", "algorithm.kl.estimator=k3")
    seqs = trainer.objective.sequences(fixed_groups())
    first = trainer.step(seqs, 1e-2)
    # Before any update the policy is the reference: every token's estimate is exactly 0.
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    later = [trainer.step(seqs, 1e-2)["kl_ref"] for _ in range(2)]
    assert later[-1] > 1e-6


def test_kl_in_the_reward_reshapes_advantages(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, 12, "algorithm.kl.coef=0.5", "algorithm.kl.where=reward",
                           "algorithm.kl.estimator=k1")
    seqs = trainer.objective.sequences(fixed_groups())
    before = [s.advantage for s in seqs]
    metrics = trainer.step(seqs, 1e-3)
    # The behaviour logprobs (-3..-7) are far from the tiny model's: a large positive k1 that
    # differs by sequence, so the advantages move.
    assert metrics["kl_ref"] != 0
    assert max(abs(a - b) for a, b in zip(before, (s.advantage for s in seqs))) > 1e-3


def test_reshape_advantages_by_hand():
    from rlmesh.learner.train.batch import Sequence
    from rlmesh.learner.train.objectives.grpo import GRPOObjective
    from rlmesh.services.config import load_config

    objective = GRPOObjective.from_config(load_config(None, ["algorithm.kl.coef=0.5", "algorithm.kl.where=reward",
                                                             "algorithm.name=dr_grpo"]))
    seqs = [Sequence([1], [2], [True], group_key=g, reward=r) for g, r in [("a", 1.0), ("a", 0.0), ("b", 1.0),
                                                                            ("b", 1.0)]]
    objective.reshape_advantages(seqs, torch.tensor([0.2, 0.0, 0.0, 1.0], dtype=torch.float64))
    # dr_grpo: r - mean. Group a: rewards 0.9, 0.0 -> +-0.45; group b: 1.0, 0.5 -> +-0.25.
    assert [s.advantage for s in seqs] == pytest.approx([0.45, -0.45, 0.25, -0.25])


def test_clamp_bounds_the_estimate_and_stops_its_gradient():
    # d = -12: k3 = exp(12) - 13 ~ 1.6e5 unclamped.
    logprobs = torch.tensor([-13.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.2])
    kl = kl_estimate(logprobs, ref, "k3", clamp=10.0)
    assert kl[0].item() == 10.0 and kl[1].item() == pytest.approx(math.exp(-0.2) - 1 + 0.2)
    kl.sum().backward()
    assert logprobs.grad[0].item() == 0.0 and logprobs.grad[1].item() != 0.0
