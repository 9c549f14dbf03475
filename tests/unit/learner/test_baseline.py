"""Fixed-seed behaviour baseline of a GRPO step through the real FSDP2 backend.

Three optimizer steps on a fixed batch of a seeded tiny Qwen2: the loss of each step and a
fingerprint of every weight afterwards must match the committed baseline, so refactors of the
learner are proven not to change training. Tolerances: loss 1e-6 absolute; each tensor's L2 norm
1e-5 relative and its sum 5e-5 of its norm (a sum cancels, so its float noise scales with the norm,
not with itself); k_proj biases are left out: softmax is invariant to them, their gradient is
float noise, and Adam turns noise into full-size steps (their sums moved by 4e-5 of their norm
between two CPUs of this workplace with the code unchanged). float32 on CPU, one torch thread. Regenerate only for an intended change
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


def assert_same_weights(got: dict, want: dict) -> None:
    for name, (total, norm) in want.items():
        if name.endswith("k_proj.bias"):
            continue
        assert got[name][1] == pytest.approx(norm, rel=1e-5), name
        assert got[name][0] == pytest.approx(total, abs=5e-5 * norm + 1e-9), name


def fixed_groups():
    """The fixed batch as the rollout tier delivers it: TrajectoryGroups."""
    from rlmesh.v1 import common_pb2

    groups = {}
    for r in fixed_sequences():
        g = groups.setdefault(r["group"], common_pb2.TrajectoryGroup(group_id=r["group"], prompt_token_ids=r["prompt"]))
        g.samples.append(common_pb2.Sample(
            index=len(g.samples), reward=r["reward"], logprobs=r["behaviour"],
            completion=common_pb2.TokenSequence(token_ids=r["completion"], loss_mask=[True] * len(r["completion"]))))
    return [groups[k] for k in sorted(groups)]


def make_trainer(model_dir: Path, micro_batch_size: int = 12, *overrides: str):
    from rlmesh.learner.train.trainer import Trainer
    from rlmesh.services.config import load_config

    config = load_config(None, ["model.type=hf", f"model.path={model_dir}", f"learner.micro_batch_size={micro_batch_size}",
                                "learner.lr=1e-3", "algorithm.name=grpo", "rollout.max_tokens=8",
                                "learner.torch_threads=1", *overrides])
    return Trainer(config, str(model_dir), pad_id=0)


def run_steps(model_dir: Path, *overrides: str) -> dict:
    """The real learner path: GRPO objective -> run_step -> FSDP2 backend."""
    trainer = make_trainer(model_dir, 12, *overrides)
    seqs = trainer.objective.sequences(fixed_groups())
    steps = [trainer.step(seqs, 1e-3) for _ in range(NUM_STEPS)]
    return {"loss": [m["loss"] for m in steps], "mismatch_kl": [m["mismatch_kl"] for m in steps],
            "weights": fingerprint(trainer.stream_weights())}


def test_grpo_step_matches_the_committed_baseline(tiny_model_dir):
    got = run_steps(tiny_model_dir)
    if os.environ.get("RLMESH_REGEN_BASELINE"):
        BASELINE.parent.mkdir(exist_ok=True)
        BASELINE.write_text(json.dumps({k: v for k, v in got.items() if k != "mismatch_kl"}, indent=1))
    want = json.loads(BASELINE.read_text())
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
    assert sorted(got["weights"]) == sorted(want["weights"])
    assert_same_weights(got["weights"], want["weights"])


def test_pi_old_from_the_training_forward_equals_a_recomputed_pi_old(tiny_model_dir):
    """The default takes pi_old from the training forward (detached) instead of a separate no-grad
    forward: with one optimizer step per batch both see the same weights, so losses, the mismatch
    metric (which reads pi_old) and the trained weights must agree."""
    fused = run_steps(tiny_model_dir)
    recomputed = run_steps(tiny_model_dir, "algorithm.recompute_old_logprobs=true")
    assert fused["loss"] == pytest.approx(recomputed["loss"], abs=1e-6)
    assert fused["mismatch_kl"] == pytest.approx(recomputed["mismatch_kl"], rel=1e-5)
    assert fused["mismatch_kl"][0] > 0  # behaviour logprobs differ from the model's: the metric is live
    assert_same_weights(fused["weights"], recomputed["weights"])


def test_a_tied_output_layer_is_sent_once_as_the_embedding(tiny_model_dir, tmp_path):
    """With tie_word_embeddings the output layer is the embedding under a second name: the broadcast
    sends it once (as the embedding; vLLM ties them too), the untied model sends both."""
    import shutil

    tied = tmp_path / "tied"
    shutil.copytree(tiny_model_dir, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    trainer = make_trainer(tied)
    sent = [m.name for m in trainer.weight_metas()]
    assert sent == [name for name, _ in trainer.stream_weights()]
    assert "model.embed_tokens.weight" in sent and "lm_head.weight" not in sent
    assert len(sent) == len(trainer.backend.weight_metas()) - 1
    assert "lm_head.weight" in [m.name for m in make_trainer(tiny_model_dir).weight_metas()]


def test_threads_are_the_learners_unless_given_and_zero_is_one_per_usable_core(tiny_model_dir):
    """RL trains with learner.torch_threads; the SFT warm start passes sft.torch_threads, whose default
    0 takes one thread per core the (pinned) process may use."""
    before = torch.get_num_threads()
    try:
        trainer = make_trainer(tiny_model_dir)
        assert torch.get_num_threads() == 1
        type(trainer)(trainer.config, str(tiny_model_dir), pad_id=0, threads=0)
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        type(trainer)(trainer.config, str(tiny_model_dir), pad_id=0, threads=3)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
