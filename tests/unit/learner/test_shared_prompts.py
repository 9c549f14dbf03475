"""Shared-prompt rows (`learner.shared_prompt_row_tokens`): each prompt written once per row with its
completions after it, under a custom attention mask. The plan covers every sequence once and keeps a
row's sequences on one prompt within the row budget; the real FSDP2 backend's logprobs, loss and
gradient equal the one-row-per-sample step's; and the forward reads fewer tokens.

Tolerance: logprobs 1e-5 absolute, loss 1e-6, each gradient 1e-5 of its norm (float32 sums in
another order)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from rlmesh.learner.train.batch import Sequence, plan_step, shared_rows  # noqa: E402

from tests.unit.learner.test_baseline import make_trainer  # noqa: E402
from tests.unit.learner.test_token_budget import _grads  # noqa: E402


def groups(num_groups: int, n: int, seed: int = 0) -> list[Sequence]:
    """GRPO-shaped batches: n samples a prompt, prompts of different lengths, ragged completions."""
    rng = random.Random(seed)
    seqs = []
    for g in range(num_groups):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(6, 20))]
        for _ in range(n):
            c = rng.randint(1, 15)
            seqs.append(Sequence(prompt, [rng.randrange(3, 200) for _ in range(c)], [rng.random() < 0.9 for _ in range(c)],
                                 [-rng.uniform(3, 7) for _ in range(c)], advantage=rng.uniform(-1, 1), group_key=f"g{g}"))
    return seqs


def test_rows_share_one_prompt_and_stay_within_their_budget():
    seqs = groups(5, 6, seed=1)
    rows = shared_rows(seqs, 40)
    assert sorted(i for row in rows for i in row) == list(range(len(seqs)))
    for row in rows:
        assert len({tuple(seqs[i].prompt_ids) for i in row}) == 1
        length = len(seqs[row[0]].prompt_ids) + sum(len(seqs[i].completion_ids) for i in row)
        assert length <= 40 or len(row) == 1
    assert len(rows) < len(seqs)  # sharing happened


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_rank_plans_the_same_number_of_micro_batches(world_size):
    seqs = groups(7, 5)
    plans = [plan_step(seqs, 8, 0, r, world_size, max_tokens=96, shared_row_tokens=64) for r in range(world_size)]
    assert len({len(p) for p in plans}) == 1
    assert sorted(i for p in plans for m in p for i in m.seq_index_B) == list(range(len(seqs)))
    unshared = sum(m.input_ids_BT.numel() for m in plan_step(seqs, 8, 0) if not m.is_padding)
    shared = sum(m.shared.input_ids_RL.numel() for p in plans for m in p if not m.is_padding)
    assert shared < 0.8 * unshared


@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
@pytest.mark.parametrize("max_tokens", [0, 200])
def test_shared_step_equals_the_one_row_per_sample_step(tiny_model_dir, algorithm, max_tokens):
    from rlmesh.learner.train.objectives.base import run_step

    trainer = make_trainer(tiny_model_dir, 8, f"algorithm.name={algorithm}")
    backend = trainer.backend
    seqs = groups(4, 6)
    plain, shared = plan_step(seqs, 8, 0), plan_step(seqs, 8, 0, max_tokens=max_tokens, shared_row_tokens=80)
    assert all(m.shared is not None for m in shared)
    with torch.no_grad():
        lp_plain, lp_shared = torch.zeros(len(seqs), 40), torch.zeros(len(seqs), 40)
        for plan, out in ((plain, lp_plain), (shared, lp_shared)):
            for m in plan:
                lp = backend._logprobs(m, 1.0) * m.loss_mask_BT
                out[m.seq_index_B, : lp.shape[1]] = lp
    assert lp_plain.abs().sum() > 0
    assert torch.allclose(lp_plain, lp_shared, atol=1e-5), (lp_plain - lp_shared).abs().max()
    # lr 0: the step leaves the weights alone, so both plans see the same model and their gradients compare.
    ref = run_step(backend, trainer.objective, seqs, micro_batch_size=8, pad_id=0, lr=0.0)
    ref_grads = _grads(backend)
    got = run_step(backend, trainer.objective, seqs, micro_batch_size=8, pad_id=0, lr=0.0,
                   max_tokens_per_micro_batch=max_tokens, shared_prompt_row_tokens=80)
    got_grads = _grads(backend)
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    assert sorted(ref_grads) == sorted(got_grads)
    for name, g in ref_grads.items():
        assert float((got_grads[name] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-9, name


def test_another_backend_is_refused_with_the_fix():
    from rlmesh.services.config import load_config

    with pytest.raises(ValueError, match="shared_prompt_row_tokens=512 .* use learner.backend.type=fsdp2"):
        load_config(None, ["learner.shared_prompt_row_tokens=512", "learner.backend.type=megatron"])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "phi3", "olmo2", "qwen3_moe"])
def test_attention_by_segment_gives_every_familys_logprobs(tmp_path, arch, monkeypatch):
    """The shared-prompt forward's attention runs by segment (`backends.shared_attention`) on the
    layers it can serve (Gemma 3's sliding-window layers keep the row's mask) and its logprobs
    are those of one row per sample, in each family's own attention module."""
    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.learner.train.backends import shared_attention
    from rlmesh.services.config import TinyModelSection

    model_dir = write_tiny_model(TinyModelSection(arch=arch, num_heads=4, num_kv_heads=2), tmp_path / arch, seed=0)
    backend = make_trainer(model_dir, 8).backend
    by_segment = []
    real = shared_attention.segment_attention
    monkeypatch.setattr(shared_attention, "segment_attention", lambda *a, **k: by_segment.append(1) or real(*a, **k))
    seqs = groups(3, 5, seed=2)
    with torch.no_grad():
        lp = {}
        for name, plan in (("plain", plan_step(seqs, 8, 0)), ("shared", plan_step(seqs, 8, 0, shared_row_tokens=60))):
            lp[name] = torch.zeros(len(seqs), 40)
            for m in plan:
                lp[name][m.seq_index_B, : m.loss_mask_BT.shape[1]] = backend._logprobs(m, 1.0) * m.loss_mask_BT
    assert lp["plain"].abs().sum() > 0
    assert torch.allclose(lp["plain"], lp["shared"], atol=1e-5), (arch, (lp["plain"] - lp["shared"]).abs().max())
    assert by_segment, f"{arch}: no layer ran by segment"
