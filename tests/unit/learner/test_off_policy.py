"""Off-policy correction modes: each against TRL's own code on the same tensors (where TRL has the
mode), the geometric-mean sequence ratio against a hand computation, and the masked fraction.

TRL (the `bench` extra, not installed by `make setup`) computes its vLLM importance-sampling
weights inline in `GRPOTrainer._generate_and_score_completions`; the test takes that block's source
from the installed trl's file (without importing trl, which takes a minute) and runs it on our
tensors, so it compares against TRL's code itself."""

from __future__ import annotations

import importlib.util
import math
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from rlmesh.learner.train.algorithms.loss import LossConfig, policy_loss  # noqa: E402
from rlmesh.learner.train.algorithms.off_policy import OffPolicyConfig, off_policy_weights  # noqa: E402
from rlmesh.learner.train.batch import Sequence, pack  # noqa: E402


def _tensors(spread: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old_BT = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 4
    # Mismatch wide enough that every mode both keeps and drops (or truncates) something.
    behaviour_BT = old_BT + (torch.rand(6, 9, generator=g, dtype=torch.float64) - 0.5) * spread
    mask_BT = (torch.rand(6, 9, generator=g) > 0.25).double()
    mask_BT[:, 0] = 1
    return old_BT, behaviour_BT, mask_BT


def _trl_weights(old_BT, behaviour_BT, mask_BT, mode: str, clip_min, clip_max) -> torch.Tensor:
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        pytest.skip("trl is not installed (the bench extra: pip install -e '.[bench]')")
    path = Path(spec.origin).parent / "trainer" / "grpo_trainer.py"
    source = path.read_text()
    start = source.index("if self.use_vllm and self.vllm_importance_sampling_correction:\n")
    end = source.index("# Compute the per-token log probabilities for the reference model", start)
    # The block as it stands in the method (TRL 1.16.0), dedented to run at top level.
    block = textwrap.dedent(source[source.rindex("\n", 0, start) + 1 : end])
    trainer = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                              vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                              vllm_importance_sampling_clip_max=clip_max)
    scope = {"self": trainer, "torch": torch, "math": math, "completion_mask": mask_BT, "tool_mask": None,
             "old_per_token_logps": old_BT, "sampling_per_token_logps": behaviour_BT}
    exec(compile(block, str(path), "exec"), scope)
    return scope["vllm_importance_sampling_ratio"].expand_as(old_BT)


@pytest.mark.parametrize("mode, trl_mode, seq_ratio, clip_min", [
    ("tis", "token_truncate", "geometric_mean", None),
    ("icepop", "token_mask", "geometric_mean", 0.7),
    ("seq_mask", "sequence_mask", "product", 0.5),
    ("seq_tis", "sequence_truncate", "product", None),
])
def test_each_mode_agrees_with_trl(mode, trl_mode, seq_ratio, clip_min):
    # A sequence's product ratio compounds its tokens': a narrower per-token mismatch there.
    old_BT, behaviour_BT, mask_BT = _tensors(0.5 if mode.startswith("seq") else 1.6)
    high = 1.5
    cfg = OffPolicyConfig(mode, tis_cap=high, low=clip_min or 0.0, high=high, seq_ratio=seq_ratio)
    ours_BT, dropped_BT = off_policy_weights(old_BT, behaviour_BT, mask_BT, cfg)
    theirs_BT = _trl_weights(old_BT, behaviour_BT, mask_BT, trl_mode, clip_min, high)
    on = mask_BT > 0
    assert torch.allclose(ours_BT[on], theirs_BT[on], rtol=0, atol=1e-6), (ours_BT - theirs_BT)[on].abs().max()
    if mode in ("icepop", "seq_mask"):
        # The tensors were chosen so the band both keeps and drops.
        assert 0 < int(dropped_BT.sum()) < int(on.sum())
        assert bool((ours_BT[dropped_BT] == 0).all())
    else:
        assert bool(((ours_BT < high) & on).any()) and bool(((ours_BT == high) & on).any())


def test_seq_mask_geometric_mean_by_hand():
    # One sequence, two loss tokens with log-ratios 0.4 and 1.0: geometric mean exp(0.7) ~ 2.01.
    old_BT = torch.tensor([[0.0, 0.0, 0.0]])
    behaviour_BT = torch.tensor([[-0.4, -1.0, -9.0]])
    mask_BT = torch.tensor([[1.0, 1.0, 0.0]])
    keep, dropped = off_policy_weights(old_BT, behaviour_BT, mask_BT, OffPolicyConfig("seq_mask", low=0.5, high=2.1))
    assert torch.allclose(keep[0, :2], torch.full((2,), math.exp(0.7)))
    assert not dropped.any()
    gone, dropped = off_policy_weights(old_BT, behaviour_BT, mask_BT, OffPolicyConfig("seq_mask", low=0.5, high=2.0))
    assert float(gone[0, :2].abs().sum()) == 0 and dropped.tolist() == [[True, True, False]]
    capped, _ = off_policy_weights(old_BT, behaviour_BT, mask_BT, OffPolicyConfig("seq_tis", tis_cap=1.5))
    assert torch.allclose(capped[0, :2], torch.full((2,), 1.5))


def test_masked_fraction_is_logged_and_dropped_tokens_give_no_gradient():
    # Sequence 0 matches its behaviour policy; sequence 1's behaviour logprobs are far off.
    seqs = [Sequence([1, 2], [3, 4, 5], [True] * 3, [-1.0] * 3, advantage=1.0),
            Sequence([1, 2], [6, 7, 8], [True] * 3, [-6.0] * 3, advantage=-1.0)]
    micro = pack(seqs, 0)
    micro.num_seqs_in_step, micro.num_loss_tokens_in_step = 2.0, 6.0
    logprobs_BT = torch.full_like(micro.loss_mask_BT, -1.0, requires_grad=True)
    cfg = LossConfig("grpo", 0.2, 0.2, 2.0, max_tokens=4, old_from_forward=True,
                     off_policy=OffPolicyConfig("seq_mask", low=0.5, high=2.0))
    loss, metrics = policy_loss(logprobs_BT, micro, cfg)
    loss.backward()
    assert metrics["off_policy_masked_frac"] == pytest.approx(0.5)
    assert float(logprobs_BT.grad[1].abs().sum()) == 0 and float(logprobs_BT.grad[0].abs().sum()) > 0
    _, tis_metrics = policy_loss(logprobs_BT, micro, LossConfig("grpo", 0.2, 0.2, 2.0, 4, old_from_forward=True))
    assert tis_metrics["off_policy_masked_frac"] == 0
