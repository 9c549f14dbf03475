"""LoRA on the learner (`learner.lora`, through peft): wrap the HF model so that only the adapter
trains, and name the adapter's tensors the way they travel and are stored.

Two forms of the same adapter:
- **stored** (checkpoints, `rlmesh export`): peft's own files, `adapter_model.safetensors` with
  `base_model.model.<module>.lora_A.weight` / `lora_B.weight` and an `adapter_config.json`
  (lora_alpha as configured), loadable with `PeftModel.from_pretrained`.
- **served** (the weight broadcast to vLLM): the same names, with peft's scale alpha / rank folded
  into every `lora_B`, so that a served adapter needs no configuration beyond what its tensors
  say (rank from their shapes, target modules from their names, lora_alpha = rank)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rlmesh.services.weights.lora import stored_name

if TYPE_CHECKING:
    import torch

    from rlmesh.services.config import LoRASection


def peft_config(cfg: LoRASection):
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=cfg.target_modules,
                      bias="none", task_type="CAUSAL_LM")


def wrap(model: torch.nn.Module, cfg: LoRASection) -> torch.nn.Module:
    """`model` with a fresh adapter (lora_B = 0: the policy starts exactly at the base model);
    every base weight frozen. Raises ValueError when no module matches `learner.lora.target_modules`."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, peft_config(cfg))
    except ValueError as err:
        raise ValueError(f"learner.lora.target_modules={cfg.target_modules!r}: {err}") from err


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM, peft-wrapped or not (what FSDP2 shards one by one)."""
    from peft import PeftModel

    inner = model.get_base_model() if isinstance(model, PeftModel) else model
    return inner.model.layers


def scale_of(cfg: LoRASection) -> float:
    return cfg.alpha / cfg.rank


def served(named: Iterator[tuple[str, torch.Tensor]], cfg: LoRASection) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter as it is broadcast: stored names, alpha / rank folded into lora_B."""
    scale = scale_of(cfg)
    for name, t in named:
        yield stored_name(name), (t * scale if ".lora_B." in name else t)


def stored_config(model: torch.nn.Module, base_model: str) -> dict:
    """adapter_config.json of a stored adapter: the wrapped model's own peft config (target modules
    resolved), pointing at `base_model`."""
    config = model.peft_config["default"].to_dict()
    config["base_model_name_or_path"] = base_model
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def merged(named: Iterator[tuple[str, torch.Tensor]], scale: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A wrapped model's (state-dict name, full tensor) stream as the plain HF model's, each adapted
    weight merged: W + scale * B @ A. Holds one base weight at a time until its A and B arrive."""
    pending: dict[str, list] = {}  # module -> [HF name, W, A]
    for name, t in named:
        name = name.removeprefix("base_model.model.")
        if ".base_layer." in name:
            module, hf_name = name.split(".base_layer.")[0], name.replace(".base_layer.", ".")
            if hf_name.endswith(".weight"):
                pending[module] = [hf_name, t, None]
            else:
                yield hf_name, t
        elif ".lora_A." in name:
            pending[name.split(".lora_A.")[0]][2] = t
        elif ".lora_B." in name:
            hf_name, weight, a = pending.pop(name.split(".lora_B.")[0])
            yield hf_name, weight + scale * (t.to(weight.dtype) @ a.to(weight.dtype))
        else:
            yield name, t
    assert not pending, f"adapted modules without lora_B: {sorted(pending)}"
