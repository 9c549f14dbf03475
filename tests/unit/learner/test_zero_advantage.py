"""A group whose samples were all scored alike has advantage zero everywhere: without a KL term its
loss and gradient are zero, so the step leaves its sequences out of the forward and backward
(`Objective.skips_zero_advantage`, `plan_step(skip_zero_advantage=True)`) while they still count in
the step's normalisers. The real FSDP2 backend on the tiny model: the same loss and gradient as
training them, at once and in parts; with a KL term in the loss they train.

Tolerance: loss 1e-6 absolute, each gradient 1e-5 of its norm (float32 sums in another order)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.learner.test_baseline import fixed_groups, make_trainer  # noqa: E402
from tests.unit.learner.test_token_budget import _grads  # noqa: E402


def with_flat_groups():
    """The fixed batch with two of its groups rescored all alike (all wrong, all right)."""
    groups = fixed_groups()
    for g, reward in ((groups[1], 0.0), (groups[3], 1.0)):
        for s in g.samples:
            s.reward = reward
    return groups


def trained_tokens(trainer, seqs) -> int:
    from rlmesh.learner.train.batch import plan_step

    micros = plan_step(seqs, 4, 0, skip_zero_advantage=trainer.objective.skips_zero_advantage)
    return sum(int(m.attention_mask_BT.sum()) for m in micros if not m.is_padding)


def step_both_ways(trainer, train):
    """`train(trainer)` once skipping zero-advantage sequences and once training them; the metrics
    and gradients of each."""
    assert trainer.objective.skips_zero_advantage
    skipped = train(trainer), _grads(trainer.backend)
    trainer.objective.skips_zero_advantage = False
    trained = train(trainer), _grads(trainer.backend)
    trainer.objective.skips_zero_advantage = True
    return skipped, trained


def assert_same_update(skipped, trained) -> None:
    (m1, g1), (m2, g2) = skipped, trained
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    assert sorted(g1) == sorted(g2)
    for name, g in g2.items():
        assert float((g1[name] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-9, name


@pytest.mark.parametrize("overrides", [
    ["algorithm.name=grpo"],
    ["algorithm.name=dr_grpo"],
    ["algorithm.name=dapo"],
    ["algorithm.name=grpo", "learner.shared_prompt_row_tokens=64", "learner.max_tokens_per_micro_batch=256"],
], ids=lambda o: ",".join(x.split("=", 1)[1] for x in o))
def test_flat_groups_train_nothing_and_are_not_trained(tiny_model_dir, overrides):
    trainer = make_trainer(tiny_model_dir, 4, "learner.train_on_arrival=false", *overrides)
    seqs = trainer.objective.sequences(with_flat_groups())
    assert sum(s.advantage == 0.0 for s in seqs) == 16
    # Half the batch is flat: the planned micro-batches hold about half the tokens.
    trainer.objective.skips_zero_advantage = False
    everything = trained_tokens(trainer, seqs)
    trainer.objective.skips_zero_advantage = True
    assert trained_tokens(trainer, seqs) < 0.7 * everything
    # lr 0: the weights stay, so both steps see the same model and their gradients compare.
    assert_same_update(*step_both_ways(trainer, lambda t: t.step(seqs, 0.0)))


def test_parts_of_flat_groups_only_train_nothing(tiny_model_dir):
    """Trained as they arrive, a part made only of flat groups runs no forward of a sample; the step's
    normaliser still counts them."""
    trainer = make_trainer(tiny_model_dir, 4)
    groups = with_flat_groups()
    assert trainer.streams

    def in_parts(t):
        for part in (groups[1:2], groups[0:1], groups[2:]):  # the first part: one flat group alone
            t.accumulate(t.objective.sequences(part))
        return t.finish(0.0)

    assert trained_tokens(trainer, trainer.objective.sequences(groups[1:2])) == 0
    assert_same_update(*step_both_ways(trainer, in_parts))


def test_a_kl_term_in_the_loss_trains_flat_groups(tiny_model_dir):
    """KL(pi_theta || pi_ref) has a gradient on every sampled token, advantage or not."""
    trainer = make_trainer(tiny_model_dir, 4, "algorithm.kl.coef=0.1", "algorithm.kl.where=loss")
    assert not trainer.objective.skips_zero_advantage
    seqs = trainer.objective.sequences(with_flat_groups())
    from rlmesh.learner.train.batch import plan_step

    micros = plan_step(seqs, 4, 0, skip_zero_advantage=trainer.objective.skips_zero_advantage)
    assert sorted(i for m in micros for i in m.seq_index_B) == list(range(len(seqs)))
