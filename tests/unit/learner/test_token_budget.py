"""Token-budget micro-batches (`learner.max_tokens_per_micro_batch`): the plan stays within the
budget, covers every sequence once, gives every rank the same number of micro-batches, and the
real FSDP2 step's loss and gradient equal the count-based padded step's.

Tolerance: loss 1e-6 absolute, each gradient 1e-5 of its norm (float32 sums in another order)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from rlmesh.learner.train.batch import Sequence, budget_groups, plan_step  # noqa: E402

from tests.unit.learner.test_baseline import make_trainer  # noqa: E402


def long_tail(num: int, seed: int = 0, max_len: int = 120) -> list[Sequence]:
    rng = random.Random(seed)
    seqs = []
    for g in range(num):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(3, 8))]
        # Mostly short completions, a few long ones: the shape that makes padding expensive.
        n = rng.randint(2, 12) if rng.random() < 0.8 else rng.randint(max_len // 2, max_len)
        completion = [rng.randrange(3, 200) for _ in range(n)]
        seqs.append(Sequence(prompt, completion, [True] * n, [-rng.uniform(3, 7) for _ in range(n)],
                             advantage=rng.uniform(-1, 1), group_key=f"g{g // 4}"))
    return seqs


def test_budget_groups_stay_within_the_budget_and_cover_each_index_once():
    lengths = [5, 300, 17, 17, 90, 3, 64, 64, 1]
    groups = budget_groups(lengths, 128)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 128 or len(g) == 1
    assert [1] in groups  # longer than the budget: alone


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_rank_plans_the_same_number_of_micro_batches(world_size):
    seqs = long_tail(37)
    plans = [plan_step(seqs, 8, 0, r, world_size, max_tokens=256) for r in range(world_size)]
    assert len({len(p) for p in plans}) == 1
    covered = sorted(i for p in plans for m in p for i in m.seq_index_B)
    assert covered == list(range(len(seqs)))
    for p in plans:
        for m in p:
            if not m.is_padding:
                assert m.input_ids_BT.numel() <= 256 or m.input_ids_BT.shape[0] == 1
    padded_tokens = sum(m.input_ids_BT.numel() for m in plan_step(seqs, 8, 0) if not m.is_padding)
    budget_tokens = sum(m.input_ids_BT.numel() for p in plans for m in p if not m.is_padding)
    assert budget_tokens < 0.7 * padded_tokens


def _grads(backend) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in backend.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "gspo"])
def test_budgeted_step_equals_the_padded_step(tiny_model_dir, algorithm):
    from rlmesh.learner.train.objectives.base import run_step

    trainer = make_trainer(tiny_model_dir, 8, f"algorithm.name={algorithm}")
    seqs = long_tail(24, max_len=60)
    # lr 0: the step leaves the weights alone, so both plans see the same model and their gradients compare.
    padded = run_step(trainer.backend, trainer.objective, seqs, micro_batch_size=8, pad_id=0, lr=0.0)
    padded_grads = _grads(trainer.backend)
    budget = run_step(trainer.backend, trainer.objective, seqs, micro_batch_size=8, pad_id=0, lr=0.0,
                      max_tokens_per_micro_batch=128)
    budget_grads = _grads(trainer.backend)
    assert budget["loss"] == pytest.approx(padded["loss"], abs=1e-6)
    assert sorted(padded_grads) == sorted(budget_grads)
    for name, g in padded_grads.items():
        assert float((budget_grads[name] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-9, name
    assert padded["grad_norm"] > 0


def test_dpo_run_refuses_the_budget():
    from rlmesh.services.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match="pairs"):
        load_config(None, ["learner.max_tokens_per_micro_batch=512", "dpo.num_steps=5"])
