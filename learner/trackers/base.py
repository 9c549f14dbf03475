"""The tracker interface (`Tracker`: log a metrics record, log an image, close; defined next to the
`MetricsWriter` that calls it), how a metrics record becomes a tracker's scalars, and where a run
(or an offline stage of it) keeps its trackers' files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlmesh.learner.trackers.metrics import Tracker

__all__ = ["RunFiles", "Tracker", "flat_config", "scalars"]


@dataclass(frozen=True)
class RunFiles:
    """One tracker run in a run directory: the RL run (`stage=None`) or an offline stage of it
    (`"sft"`, `"dpo"`), which gets its own TensorBoard logdir, run name and run-id files."""

    run_dir: Path
    run_name: str
    stage: str | None = None

    @property
    def name(self) -> str:
        return f"{self.run_name}-{self.stage}" if self.stage else self.run_name

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir / "tensorboard" / self.stage if self.stage else self.run_dir / "tensorboard"

    def id_file(self, tracker: str) -> Path:
        """Where this run's id in `tracker` is kept: `<run_dir>/<tracker>_run_id.txt`
        (`<tracker>_<stage>_run_id.txt` for a stage)."""
        return self.run_dir / (f"{tracker}_{self.stage}_run_id.txt" if self.stage else f"{tracker}_run_id.txt")

    def resumed_id(self, tracker: str) -> str | None:
        """The id of this run directory's earlier run in `tracker`, to continue: None when there is
        none, and for an offline stage, which trains from scratch and so starts a new run each time."""
        path = self.id_file(tracker)
        return path.read_text().strip() if path.exists() and not self.stage else None


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """A record's step (its policy version; an offline recipe's step) and its numbers, flattened
    and named by its kind:
    `{"kind": "eval", "accuracy_by_env": {"math": 0.5}}` -> `{"eval/accuracy_by_env/math": 0.5}`.
    Strings (digests, paths) are not metrics and are left out."""
    kind = record.get("kind", "metrics")
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (int, float)):
            out[prefix] = float(value)

    for key, value in record.items():
        if key not in ("kind", "time", "version", "step"):
            walk(f"{kind}/{key}", value)
    return int(record.get("version", record.get("step", 0))), out


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """The resolved run config as flat `section.key` hyperparameters (lists and None as strings)."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, name + "."))
        else:
            out[name] = value if isinstance(value, (str, int, float, bool)) else str(value)
    return out
