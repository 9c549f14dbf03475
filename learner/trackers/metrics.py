"""Run metrics: one JSON object per line in `<run_dir>/metrics.jsonl` (also handed to the
experiment trackers and the Prometheus hook a writer is given), and the reward-curve PNG."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Tracker(Protocol):
    """What a writer hands its records to (`rlmesh.learner.trackers.base.Tracker` is the same)."""

    def log(self, record: dict[str, Any]) -> None: ...
    def log_image(self, name: str, path: Path, step: int) -> None: ...
    def close(self) -> None: ...


class MetricsWriter:
    """Appends records to a JSONL file and hands each to its trackers. The trackers run on one
    background thread, in order: their writes (TensorBoard's and MLflow's take 10-15 ms a record on
    this machine) stay off the learner loop's critical path. A tracker's error is raised by the next
    `write` or by `close`, which waits for every record handed over."""

    def __init__(self, run_dir: Path, name: str = "metrics.jsonl", trackers: Sequence[Tracker] = ()) -> None:
        self.path = run_dir / name
        self._f = self.path.open("a", buffering=1)
        self.trackers = list(trackers)
        self._error: BaseException | None = None
        self._pending: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._feed, name=f"trackers-{name}", daemon=True)
        if self.trackers:
            self._thread.start()

    def _feed(self) -> None:
        while (call := self._pending.get()) is not None:
            if self._error is None:
                try:
                    call()
                except BaseException as err:  # re-raised on the writer's thread
                    self._error = err

    def _hand(self, call: Callable[[], Any]) -> None:
        if self._error is not None:
            raise RuntimeError(f"a metrics tracker failed: {self._error!r}") from self._error
        if self.trackers:
            self._pending.put(call)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({"time": round(time.time(), 3), **record})
        self._f.write(line + "\n")
        self._hand(lambda: self._log(line))

    def _log(self, line: str) -> None:
        # The trackers get the line as written, decoded on their thread: what the caller changes
        # in its record afterwards never reaches them.
        record = json.loads(line)
        for tracker in self.trackers:
            tracker.log(record)

    def log_image(self, name: str, path: Path, step: int) -> None:
        self._hand(lambda: self._log_image(name, path, step))

    def _log_image(self, name: str, path: Path, step: int) -> None:
        for tracker in self.trackers:
            tracker.log_image(name, path, step)

    def close(self) -> None:
        self._f.close()
        if self.trackers:
            self._pending.put(None)
            self._thread.join()
        for tracker in self.trackers:
            tracker.close()
        if self._error is not None:
            raise RuntimeError(f"a metrics tracker failed: {self._error!r}") from self._error


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now
    return out


def surviving_lineage(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `trained_groups.jsonl` rows of the versions that survived: a `{"resumed_from": v}` row
    (written when a learner resumes from the checkpoint at version v) supersedes every earlier row
    of a version above v, whose training was lost with the crash."""
    kept: list[dict[str, Any]] = []
    for row in rows:
        if "resumed_from" in row:
            kept = [r for r in kept if r["version"] <= row["resumed_from"]]
        else:
            kept.append(row)
    return kept


def current_rows(rows: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The `kind` rows ("train" or "eval") of the run as it stands, by version. A learner that resumes
    from a checkpoint at version v writes versions after v again: for train rows, one at or below the
    last one's version supersedes every earlier row from its version on (their training was lost);
    for an evaluation, the last record of a version stands."""
    if kind != "train":
        return sorted({r["version"]: r for r in rows if r.get("kind") == kind}.values(), key=lambda r: r["version"])
    kept: list[dict[str, Any]] = []
    for row in rows:
        if row.get("kind") == kind:
            kept = [r for r in kept if r["version"] < row["version"]]
            kept.append(row)
    return kept


def plot_reward_curve(metrics_path: Path, png_path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train, evals = current_rows(rows, "train"), current_rows(rows, "eval")
    if not train:
        return None
    lengths = [(r["version"], r["completion_tokens"]) for r in train if r.get("completion_tokens")]
    fig, axes = plt.subplots(1, 2 if lengths else 1, figsize=(12 if lengths else 7, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot([r["version"] for r in train], [r["reward_mean"] for r in train], label="train reward (mean over samples)")
    if any(r.get("num_dropped_flat") for r in train):  # dynamic sampling: the trained groups are the mixed ones
        ax.plot([r["version"] for r in train], [r.get("reward_mean_generated", r["reward_mean"]) for r in train],
                label="reward of all samples generated (incl. all-equal groups dropped)")
    if evals:
        ax.plot([r["version"] for r in evals], [r["accuracy"] for r in evals], "o--", label="held-out accuracy (greedy)")
    ax.set_xlabel("policy version (optimizer steps)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title("rlmesh GRPO reward curve")
    if lengths:
        _plot_lengths(axes[0][1], lengths)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def _plot_lengths(ax, lengths: list[tuple[int, list[int]]]) -> None:
    """Completion tokens per step: the mean and the spread (min to max) of the step's samples."""
    versions = [v for v, _ in lengths]
    ax.plot(versions, [sum(c) / len(c) for _, c in lengths], label="mean")
    ax.fill_between(versions, [min(c) for _, c in lengths], [max(c) for _, c in lengths], alpha=0.2,
                    label="min to max")
    ax.set_xlabel("policy version (optimizer steps)")
    ax.set_ylabel("completion tokens")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    ax.set_title("completion length")
