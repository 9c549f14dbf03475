"""Experiment trackers behind one interface (`base.Tracker`): TensorBoard, Weights & Biases and
MLflow, one module each, imported only when `logging.trackers` names them. The learner's
`MetricsWriter` hands every record it writes to metrics.jsonl to each of them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlmesh.learner.trackers.base import Tracker
    from rlmesh.services.config import LoggingSection

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")


def build_trackers(logging: LoggingSection, run_dir: Path, run_name: str, config: dict[str, Any]) -> list[Tracker]:
    """The trackers `logging.trackers` names (jsonl is metrics.jsonl itself, always written), each
    continuing this run directory's earlier run if there is one, with `config` as hyperparameters."""
    out: list[Tracker] = []
    for name in dict.fromkeys(logging.trackers):
        if name == "jsonl":
            continue
        try:
            out.append(_build(name, logging, run_dir, run_name, config))
        except ImportError as err:
            raise ValueError(f"logging.trackers names {name!r}, whose package is not installed ({err}); "
                             f"install it with `pip install 'rlmesh[trackers]'` or drop {name!r}") from None
    return out


def _build(name: str, logging: LoggingSection, run_dir: Path, run_name: str, config: dict[str, Any]) -> Tracker:
    if name == "tensorboard":
        from rlmesh.learner.trackers.tensorboard import TensorBoardTracker

        return TensorBoardTracker(run_dir, config)
    if name == "wandb":
        from rlmesh.learner.trackers.wandb import WandbTracker

        return WandbTracker(run_dir, run_name, config, project=logging.wandb_project)
    if name == "mlflow":
        from rlmesh.learner.trackers.mlflow import MlflowTracker

        return MlflowTracker(run_dir, run_name, config, tracking_uri=logging.mlflow_tracking_uri,
                             experiment=logging.mlflow_experiment)
    raise ValueError(f"logging.trackers: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
