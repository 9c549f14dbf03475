"""Durable checkpoints, written by every learner rank with torch.distributed.checkpoint (DCP), so
they resume on any number of ranks:

    step_000010/
      dcp/                 sharded model + optimizer state
      rng_rank{r}.pt       each rank's RNG state
      trainer_state.json   version, data cursor, trained group ids, run id, LR schedule position
      hf_config/           the model's config and tokenizer (for `rlmesh export`)
      model/               an HF model directory (with checkpoint.hf_model; gathered on rank 0;
                           with learner.lora, the adapter merged in)
      adapter/             with learner.lora: the adapter alone, in peft's format

Written to a temporary directory and renamed into place, so a checkpoint exists whole or not at all."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlmesh.learner.train.trainer import Trainer

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def save_checkpoint(root: Path, version: int, trainer: Trainer, model_dir: str, state: dict[str, Any],
                    keep_last: int, hf_model: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{version:06d}"
    tmp = root / f".tmp_step_{version:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    trainer.save(tmp)  # every rank writes its shards
    hf = tmp / "hf_config"
    hf.mkdir()
    for f in Path(model_dir).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, hf / f.name)
    if hf_model:
        trainer.save_pretrained(tmp / "model")
        for f in hf.iterdir():
            if f.name != "config.json":
                shutil.copy2(f, tmp / "model" / f.name)
    (tmp / "trainer_state.json").write_text(json.dumps({"version": version, **state}))
    for path in tmp.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(root.glob("step_*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    found = sorted(root.glob("step_*")) if root.is_dir() else []
    return found[-1] if found else None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    root = run_dir / "checkpoints"
    if step is None:
        found = latest_checkpoint(root)
        if found is None:
            raise ValueError(f"{run_dir} has no checkpoints (looked for {root}/step_*)")
        return found
    path = root / f"step_{step:06d}"
    if not path.is_dir():
        have = ", ".join(p.name for p in sorted(root.glob("step_*"))) or "none"
        raise ValueError(f"no checkpoint for step {step} in {root} (have: {have})")
    return path


EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")


def export_hf(checkpoint: Path, output: Path, merge: bool = False, dtype: str = "auto") -> Path:
    """Write an HF model directory from a DCP checkpoint, in this one process (no process group).
    A LoRA run's checkpoint (learner.lora, with `adapter/`) exports its adapter in peft's format,
    or with `merge` the base model with the adapter merged in. The weights are written in `dtype`;
    "auto" is the dtype of the model the run started from (a bf16 model comes back bf16, its
    float32 master weights rounded once), float32 where the model names none."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = checkpoint / "hf_config"
    adapter = checkpoint / "adapter"
    output.mkdir(parents=True, exist_ok=True)
    if adapter.is_dir() and not merge:
        shutil.copytree(adapter, output, dirs_exist_ok=True)
    else:
        config = AutoConfig.from_pretrained(hf)
        dtype = export_dtype(config, dtype)  # before from_config, which sets the config's dtype to its own
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if adapter.is_dir():
            from peft import LoraConfig, get_peft_model

            # The trained state is the wrapped model's (base weights under peft's names, plus the adapter).
            lora = LoraConfig.from_pretrained(str(adapter))
            lora.base_model_name_or_path = model.name_or_path  # the checkpoint's own base, not the run's path
            model = get_peft_model(model, lora)
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(checkpoint / "dcp"))
        model.load_state_dict(state["model"])
        if adapter.is_dir():
            model = model.merge_and_unload()
        model.to(getattr(torch, dtype))
        model.save_pretrained(output, safe_serialization=True)
    for f in hf.iterdir():
        if f.name != "config.json":
            shutil.copy2(f, output / f.name)
    return output


def export_dtype(config: Any, asked: str) -> str:
    """The dtype an export writes: the one asked for, or ("auto") the source model's own."""
    if asked != "auto":
        return asked
    source = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    source = source.removeprefix("torch.")
    return source if source in EXPORT_DTYPES else "float32"
