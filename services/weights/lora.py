"""A LoRA adapter as it travels and as it is stored, shared by the learner (which sends and saves
it) and the rollout server (which writes what it received for vLLM to load): peft's file layout,
`adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` / `lora_B.weight`
tensors and an `adapter_config.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def stored_name(name: str) -> str:
    """peft's file name for a wrapped model's state-dict key (the adapter name "default" dropped)."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def served_config(tensors: dict[str, torch.Tensor]) -> dict:
    """adapter_config.json for a served adapter: rank and target modules read off its tensors,
    lora_alpha = rank (its scale is already in lora_B)."""
    ranks = {t.shape[0] for n, t in tensors.items() if ".lora_A." in n}
    if len(ranks) != 1:
        raise ValueError(f"adapter tensors have lora_A ranks {sorted(ranks)}; expected one rank")
    rank = ranks.pop()
    targets = sorted({n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n in tensors if ".lora_A." in n})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "modules_to_save": None}


def write_adapter(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """An adapter directory (`adapter_model.safetensors` + `adapter_config.json`), written under a
    temporary name and renamed into place, so a reader never sees half of it."""
    import os
    import shutil

    from safetensors.torch import save_file

    tmp = path.with_name(f".tmp_{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, str(tmp / ADAPTER_WEIGHTS))
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
