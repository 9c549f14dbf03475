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
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlmesh.services.config import CheckpointSection, default

if TYPE_CHECKING:
    from rlmesh.learner.train.trainer import Trainer

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def save_checkpoint(root: Path, version: int, trainer: Trainer, model_dir: str, state: dict[str, Any],
                    keep_last: int, hf_model: bool = default(CheckpointSection, "hf_model")) -> Path:
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
        if dtype in ("bfloat16", "float16"):
            warn_if_rounded_back(model.state_dict(), checkpoint, dtype)
        model.to(getattr(torch, dtype))
        model.save_pretrained(output, safe_serialization=True)
    for f in hf.iterdir():
        if f.name != "config.json":
            shutil.copy2(f, output / f.name)
    return output


def warn_if_rounded_back(state: dict[str, Any], checkpoint: Path, dtype: str) -> float | None:
    """Warn when rounding the trained float32 weights to `dtype` puts most of them back where the run started
    (updates smaller than half a 16-bit step vanish: after a short RL run at lr 1e-5, 94% of SmolLM2's weights
    did, and the export's greedy answers were the learner's on 0 of 8 prompts, against 8 of 8 in float32).
    Compares with the run's starting model when its directory is still there; returns the fraction, or None
    (also when the run computed in `dtype` itself: learner.backend.param_dtype=bfloat16 trains and serves the
    rounded weights, so the export in that dtype is the policy the run measured)."""
    import torch
    from safetensors import safe_open

    try:
        import yaml

        run_config = yaml.safe_load((checkpoint.parent.parent / "config.resolved.yaml").read_text())
        start = Path(run_config["model"]["path"])
        files = sorted(start.glob("*.safetensors"))
        computed = ((run_config.get("learner") or {}).get("backend") or {}).get("param_dtype")
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        return None
    if computed == dtype:  # the run computed (and served) these very rounded weights: nothing to lose
        return None
    target = getattr(torch, dtype)
    same = total = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name in state and list(state[name].shape) == list(f.get_slice(name).get_shape()):
                    same += int((state[name].to(target) == f.get_tensor(name).to(target)).sum())
                    total += state[name].numel()
    if not total:
        return None
    fraction = same / total
    if fraction > 0.5:
        log.warning("%.0f%% of the weights round back to the starting model's (%s) in %s: most of what the run "
                    "learned is below %s's precision and this export loses it. Export with --dtype float32 to keep "
                    "the learner's weights exactly.", 100 * fraction, start, dtype, dtype)
    return fraction


def export_dtype(config: Any, asked: str) -> str:
    """The dtype an export writes: the one asked for, or ("auto") the source model's own."""
    if asked != "auto":
        return asked
    source = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    source = source.removeprefix("torch.")
    return source if source in EXPORT_DTYPES else "float32"
