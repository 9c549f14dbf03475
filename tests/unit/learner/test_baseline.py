"""Fixed-seed behaviour baseline of a GRPO step through the real FSDP2 backend.

Three optimizer steps on a fixed batch of a seeded tiny Qwen2: the loss of each step and a
fingerprint of every weight afterwards must match the committed baseline, so refactors of the
learner are proven not to change training. Tolerances: loss 1e-6 absolute; each tensor's sum and
L2 norm 1e-5 relative (float32 on CPU, one torch thread). Regenerate only for an intended change
of behaviour: RLMESH_REGEN_BASELINE=1 pytest tests/unit/learner/test_baseline.py"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BASELINE = Path(__file__).parent / "baselines" / "grpo_fsdp2.json"
NUM_STEPS = 3


def fixed_sequences(vocab: int = 200):
    """32 sequences in 4 groups of 8: varied prompt/completion lengths, rewards and behaviour
    logprobs, as a rollout would deliver them."""
    from learner.batch import Sequence

    rng = random.Random(1234)
    seqs = []
    for g in range(4):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 9))]
        rewards = [float(rng.random() < 0.5) for _ in range(8)]
        rewards[0], rewards[1] = 1.0, 0.0  # every group has signal
        for i in range(8):
            completion = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 7))]
            seqs.append(dict(prompt=prompt, completion=completion, reward=rewards[i],
                             behaviour=[-rng.uniform(3.0, 7.0) for _ in completion], group=f"g{g}"))
    return seqs


def fingerprint(named) -> dict[str, list[float]]:
    return {n: [float(t.double().sum()), float(t.double().norm())] for n, t in named}


def run_steps(model_dir: Path) -> dict:
    from functools import partial

    from learner.algorithms.advantages import group_advantages
    from learner.algorithms.loss import LossConfig, policy_loss
    from learner.backends.fsdp2 import FSDP2Backend
    from learner.batch import Sequence, split_micro_batches

    torch.set_num_threads(1)
    backend = FSDP2Backend(str(model_dir), lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, seed=0)
    cfg = LossConfig("grpo", 0.2, 0.2, 2.0, 8)
    rows = fixed_sequences()
    seqs = []
    for g in sorted({r["group"] for r in rows}):
        members = [r for r in rows if r["group"] == g]
        adv = group_advantages(torch.tensor([r["reward"] for r in members]), "grpo")
        seqs += [Sequence(r["prompt"], r["completion"], [True] * len(r["completion"]), r["behaviour"], a, g)
                 for r, a in zip(members, adv.tolist())]
    losses = []
    for _ in range(NUM_STEPS):
        micros = split_micro_batches(seqs, 12, 0)
        for m in micros:
            m.old_logprobs_BT = backend.compute_logprobs(m, 1.0)
        step_loss = []

        def loss_fn(logprobs_BT, micro):
            loss, metrics = policy_loss(logprobs_BT, micro, cfg=cfg)
            step_loss.append(float(loss))
            return loss, metrics

        backend.train_step(micros, loss_fn, 1.0)
        losses.append(sum(step_loss))
    return {"loss": losses, "weights": fingerprint(backend.full_weights())}


def test_grpo_step_matches_the_committed_baseline(tiny_model_dir):
    got = run_steps(tiny_model_dir)
    if os.environ.get("RLMESH_REGEN_BASELINE"):
        BASELINE.parent.mkdir(exist_ok=True)
        BASELINE.write_text(json.dumps(got, indent=1))
    want = json.loads(BASELINE.read_text())
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    assert sorted(got["weights"]) == sorted(want["weights"])
    for name, (total, norm) in want["weights"].items():
        assert got["weights"][name][1] == pytest.approx(norm, rel=1e-5), name
        assert got["weights"][name][0] == pytest.approx(total, rel=1e-5, abs=1e-6), name
