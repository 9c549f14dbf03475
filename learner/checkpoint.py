"""Durable checkpoints: an HF model directory plus trainer state, written to a temporary
directory and renamed into place, so a checkpoint either exists whole or not at all."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(root: Path, version: int, backend, tokenizer, state: dict[str, Any], keep_last: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{version:06d}"
    tmp = root / f".tmp_step_{version:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    backend.save_pretrained(str(tmp / "model"))
    tokenizer.save_pretrained(str(tmp / "model"))
    torch.save({"backend": backend.state_dict_for_checkpoint(), **state}, tmp / "trainer_state.pt")
    (tmp / "meta.json").write_text(json.dumps({"version": version}))
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
