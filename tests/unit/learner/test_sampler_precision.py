"""The learner warns when vLLM would sample from 16-bit weights of a policy it computes in float32."""

from __future__ import annotations

from rlmesh.learner.rl.server import sampler_precision_warning
from rlmesh.services.config import load_config


def _warning(*overrides: str) -> str:
    return sampler_precision_warning(load_config("examples/smollm2_grpo.yaml", list(overrides)))


def test_bf16_serving_of_a_float32_learner_is_warned_with_the_fix():
    warning = _warning("rollout.dtype=bfloat16", "learner.backend.param_dtype=float32")
    assert "rollout.dtype=bfloat16 with learner.backend.param_dtype=float32" in warning
    assert "learner.backend.param_dtype=bfloat16" in warning and "rollout.dtype=float32" in warning


def test_matching_precisions_and_adapters_are_not_warned():
    assert _warning() == ""  # the demo: vLLM serves float32, whatever the learner computes in
    # auto may resolve to float32, which bf16-served weights would lag
    assert "learner.backend.param_dtype=auto" in _warning("rollout.dtype=bfloat16", "learner.backend.param_dtype=auto")
    assert _warning("rollout.dtype=bfloat16", "learner.backend.param_dtype=bfloat16") == ""
    assert _warning("rollout.dtype=bfloat16", "learner.lora.rank=16") == ""  # adapters start from zero
