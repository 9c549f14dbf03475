"""The names the learner sends, made the names vLLM's loaders read. The learner streams its model's
state dict as transformers holds it in memory, and transformers 5 holds some families in another
layout than their checkpoints: a mixture-of-experts layer is one fused 3-D `experts.gate_up_proj` /
`experts.down_proj` (Qwen2-MoE, Qwen3-MoE, Mixtral, whose `mlp` is also `block_sparse_moe` on disk),
where the checkpoint, and so every vLLM loader, has one `experts.{e}.gate_proj.weight` per expert.
transformers' own `revert_weight_conversion` (what `save_pretrained` writes with) turns the one into
the other; it is planned once per layout on meta tensors, so a family stored as on disk (Llama, Qwen2,
Gemma 3, ...) streams through untouched. Imports torch; transformers only when a layout is planned."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rlmesh.services.weights.wire import TensorMeta

TIED_HEAD = "lm_head.weight"


class CheckpointLayout:
    """Per receiving engine: converts each update's (name, tensor) stream to checkpoint names."""

    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._planned: list[TensorMeta] | None = None
        self._meta_model: torch.nn.Module | None = None
        self.reverts = False
        """Whether the last planned layout needs transformers' conversion (else names pass as they are)."""

    def plan(self, metas: list[TensorMeta]) -> None:
        """Decide, from names and shapes alone, whether `metas` need converting (cached per layout)."""
        if metas == self._planned:
            return
        empty = {m.name: torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta") for m in metas}
        model = self._hf_meta_model()
        converted = _revert(model, empty) if model is not None else empty
        self.reverts = sorted(converted) != sorted(empty)
        self._planned = list(metas)

    def convert(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream in checkpoint names. Where the layout needs converting, the whole stream is
        taken first (a fused tensor becomes views of its experts). A tied output layer sent under its
        own name is dropped: vLLM's head is the embedding, loaded once from `model.embed_tokens.weight`."""
        if self.reverts:
            named = _revert(self._hf_meta_model(), dict(named)).items()
        for name, tensor in named:
            if not (self.tied and name == TIED_HEAD):
                yield name, tensor

    def _hf_meta_model(self) -> torch.nn.Module | None:
        """The HF model of the served config on the meta device (no memory): what transformers plans its
        conversions from. None where transformers has no causal-LM class for it (names then pass as sent)."""
        if self._meta_model is None:
            from transformers import AutoModelForCausalLM

            try:
                with torch.device("meta"):
                    self._meta_model = AutoModelForCausalLM.from_config(self.hf_config)
            except ValueError:  # "Unrecognized configuration class": no HF causal LM to take a layout from
                return None
        return self._meta_model


def _revert(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state)
