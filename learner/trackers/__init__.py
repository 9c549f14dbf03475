"""Experiment trackers behind one interface (`base.Tracker`): TensorBoard, Weights & Biases and
MLflow, one module each, imported only when `logging.trackers` names them. The learner's
`MetricsWriter` hands every record it writes to metrics.jsonl to each of them; so does the offline
loop of `rlmesh sft` and `rlmesh dpo`, whose runs are stages of the run directory (`stage`: their own
TensorBoard sub-run, W&B and MLflow runs named `<run>-<stage>`), apart from the RL steps."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlmesh.learner.trackers.base import RunFiles

if TYPE_CHECKING:
    from rlmesh.learner.trackers.base import Tracker
    from rlmesh.services.config import LoggingSection

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")


def build_trackers(logging: LoggingSection, run_dir: Path, run_name: str, config: dict[str, Any], *,
                   stage: str | None = None) -> list[Tracker]:
    """The trackers `logging.trackers` names (jsonl is metrics.jsonl itself, always written), with
    `config` as hyperparameters. The RL run (`stage=None`) continues this run directory's earlier
    run if there is one; an offline stage (`"sft"`, `"dpo"`) trains from scratch, so it starts a new
    run each time, under its own TensorBoard logdir `tensorboard/<stage>` and run name `<run_name>-<stage>`
    (its steps count from 1 again and would otherwise collide with the RL steps)."""
    out: list[Tracker] = []
    for name in dict.fromkeys(logging.trackers):
        if name == "jsonl":
            continue
        try:
            out.append(_build(name, logging, run_dir, run_name, config, stage))
        except ImportError as err:
            raise ValueError(f"logging.trackers names {name!r}, whose package is not installed ({err}); "
                             f"install it with `pip install 'rlmesh[trackers]'` or drop {name!r}") from None
    return out


def _build(name: str, logging: LoggingSection, run_dir: Path, run_name: str, config: dict[str, Any],
           stage: str | None) -> Tracker:
    run = RunFiles(run_dir, run_name, stage)
    if name == "tensorboard":
        from rlmesh.learner.trackers.tensorboard import TensorBoardTracker

        return TensorBoardTracker(run.tensorboard_dir, config)
    if name == "wandb":
        from rlmesh.learner.trackers.wandb import WandbTracker

        return WandbTracker(run, config, project=logging.wandb_project)
    if name == "mlflow":
        from rlmesh.learner.trackers.mlflow import MlflowTracker

        return MlflowTracker(run, config, tracking_uri=logging.mlflow_tracking_uri,
                             experiment=logging.mlflow_experiment)
    raise ValueError(f"logging.trackers: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
