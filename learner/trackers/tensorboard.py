"""TensorBoard: event files in `<run_dir>/tensorboard` (a resumed run appends to the same logdir); an
offline stage (SFT, DPO) writes its own sub-run, `<run_dir>/tensorboard/<stage>`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlmesh.learner.trackers.base import flat_config, scalars


class TensorBoardTracker:
    def __init__(self, logdir: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.logdir = logdir
        self._writer = SummaryWriter(log_dir=str(self.logdir))
        # The hparams plugin's summaries, written into this logdir (add_hparams would make a sub-run).
        for summary in hparams(flat_config(config), {}):
            self._writer.file_writer.add_summary(summary)

    def log(self, record: dict[str, Any]) -> None:
        # One event holding every scalar of the record: an add_scalar per key writes (and
        # checksums) an event per key, ~40 a step.
        from tensorboard.compat.proto.summary_pb2 import Summary

        step, values = scalars(record)
        summary = Summary(value=[Summary.Value(tag=key, simple_value=value) for key, value in values.items()])
        self._writer.file_writer.add_summary(summary, step)

    def log_image(self, name: str, path: Path, step: int) -> None:
        from matplotlib.image import imread

        self._writer.add_image(name, imread(path)[..., :3], step, dataformats="HWC")

    def close(self) -> None:
        self._writer.close()
