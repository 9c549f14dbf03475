"""MLflow: a local file store in `<run_dir>/mlruns` unless `logging.mlflow_tracking_uri` names a
server. The run id is kept in `<run_dir>/mlflow_run_id.txt`, so a resumed learner continues the
same MLflow run; an offline stage (SFT, DPO) is its own run in the same experiment, `<run>-<stage>`."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rlmesh.learner.trackers.base import RunFiles, flat_config, scalars

MAX_BATCH = 100  # MLflow's log_batch limit on params (and a sensible chunk for metrics)


class MlflowTracker:
    def __init__(self, files: RunFiles, config: dict[str, Any], *, tracking_uri: str | None, experiment: str) -> None:
        from mlflow.tracking import MlflowClient

        if tracking_uri is None:
            # MLflow 3 refuses its file store unless asked; it needs no database and no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = tracking_uri or (files.run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        resumed = files.resumed_id("mlflow")
        if resumed is not None:
            self.run_id = resumed
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=files.name).info.run_id
            files.id_file("mlflow").write_text(self.run_id + "\n")
            self._params(config)

    def _params(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in flat_config(config).items()]
        for i in range(0, len(params), MAX_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MAX_BATCH])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, values = scalars(record)
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MAX_BATCH])

    def log_image(self, name: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
