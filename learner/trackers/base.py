"""The tracker interface (`Tracker`: log a metrics record, log an image, close; defined next to the
`MetricsWriter` that calls it), and how a metrics record becomes a tracker's scalars."""

from __future__ import annotations

from typing import Any

from rlmesh.learner.metrics import Tracker

__all__ = ["Tracker", "flat_config", "scalars"]


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """A record's step (its policy version) and its numbers, flattened and named by its kind:
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
        if key not in ("kind", "time", "version"):
            walk(f"{kind}/{key}", value)
    return int(record.get("version", 0)), out


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
