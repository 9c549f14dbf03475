"""Weights & Biases: offline unless WANDB_MODE says otherwise (`wandb sync <run_dir>/wandb` uploads
it later). The run id is kept in `<run_dir>/wandb_run_id.txt`, so a resumed learner continues the
same W&B run; an offline stage (SFT, DPO) is its own run, `<run>-<stage>`, of job type `<stage>`."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from rlmesh.learner.trackers.base import RunFiles, scalars


class WandbTracker:
    def __init__(self, files: RunFiles, config: dict[str, Any], *, project: str) -> None:
        import wandb

        run_id = files.resumed_id("wandb") or uuid.uuid4().hex[:8]
        files.id_file("wandb").write_text(run_id + "\n")
        self._wandb = wandb
        self.run = wandb.init(project=project, name=files.name, id=run_id, resume="allow", dir=str(files.run_dir),
                              group=files.run_name, job_type=files.stage or "rl",
                              config=config, mode=os.environ.get("WANDB_MODE", "offline"),
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, record: dict[str, Any]) -> None:
        step, values = scalars(record)
        self.run.log(values, step=step)

    def log_image(self, name: str, path: Path, step: int) -> None:
        self.run.log({name: self._wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self.run.finish()
