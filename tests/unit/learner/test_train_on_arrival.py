"""A step trained in parts as its groups arrive (`learner.train_on_arrival`: `Trainer.accumulate` per
part, then `Trainer.finish`) gives the update that training the whole batch at once gives: the real
FSDP2 backend on the tiny model, the parts' summed-loss gradient divided by the whole step's normaliser.

Tolerance: loss 1e-6 absolute, each gradient 1e-5 of its norm (float32 sums in another order)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.unit.learner.test_baseline import fixed_groups, make_trainer  # noqa: E402
from tests.unit.learner.test_token_budget import _grads  # noqa: E402


@pytest.mark.parametrize("overrides", [
    ["algorithm.name=grpo"],
    ["algorithm.name=dapo"],
    ["algorithm.name=dr_grpo"],
    ["algorithm.name=gspo"],
    # The demo's micro-batching: shared prompt rows under a token budget.
    ["algorithm.name=grpo", "learner.shared_prompt_row_tokens=64", "learner.max_tokens_per_micro_batch=256"],
    # A KL penalty in the loss: the reference's logprobs are taken part by part.
    ["algorithm.name=grpo", "algorithm.kl.coef=0.1", "algorithm.kl.where=loss"],
], ids=lambda o: ",".join(x.split("=", 1)[1] for x in o))
def test_a_step_trained_in_parts_equals_the_whole_batch_at_once(tiny_model_dir, overrides):
    trainer = make_trainer(tiny_model_dir, 4, *overrides)
    assert trainer.streams
    groups = fixed_groups()
    assert len(groups) >= 3
    # lr 0: the steps leave the weights alone, so both see the same model and their gradients compare.
    whole = trainer.step(trainer.objective.sequences(groups), 0.0)
    whole_grads = _grads(trainer.backend)
    for part in (groups[:1], groups[1:3], groups[3:]):  # unequal parts, as arrivals come
        trainer.accumulate(trainer.objective.sequences(part))
    parts = trainer.finish(0.0)
    parts_grads = _grads(trainer.backend)
    assert parts["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert parts["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert parts["accumulated_s"] > 0
    assert sorted(whole_grads) == sorted(parts_grads)
    for name, g in whole_grads.items():
        assert float((parts_grads[name] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-9, name


def test_the_next_step_starts_from_no_gradient(tiny_model_dir):
    """A second step in parts holds only its own parts' gradient, not the last step's too (no
    clipping here: it would scale a doubled gradient back to the same one)."""
    trainer = make_trainer(tiny_model_dir, 4, "learner.max_grad_norm=1e9")
    groups = fixed_groups()
    trainer.accumulate(trainer.objective.sequences(groups))
    trainer.finish(0.0)
    first = _grads(trainer.backend)
    trainer.accumulate(trainer.objective.sequences(groups))
    trainer.finish(0.0)
    second = _grads(trainer.backend)
    for name, g in first.items():
        assert float((second[name] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-9, name


@pytest.mark.parametrize("overrides", [
    ["learner.train_on_arrival=false"],
    # The penalty in the reward reshapes advantages across the whole step: it trains at once.
    ["algorithm.kl.coef=0.1", "algorithm.kl.where=reward"],
])
def test_steps_that_cannot_be_trained_in_parts_train_at_once(tiny_model_dir, overrides):
    trainer = make_trainer(tiny_model_dir, 4, *overrides)
    assert not trainer.streams
    with pytest.raises(AssertionError, match="cannot be trained in parts"):
        trainer.accumulate(trainer.objective.sequences(fixed_groups()))
