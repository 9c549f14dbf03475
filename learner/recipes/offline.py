"""The offline training loop that SFT and DPO share: each step draws a batch of examples, the
objective makes its sequences, the trainer steps; the step's metrics are written, the held-out
set is evaluated every `eval_every` steps and at the end, and the trained model is saved as an HF
directory (tokenizer and generation config included). The step metrics go to a JSONL file and to
the experiment trackers `logging.trackers` names, as a stage of the run directory (`stage_metrics`)."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlmesh.learner.trackers.metrics import MetricsWriter
from rlmesh.services.config import DPOSection, default

if TYPE_CHECKING:
    from rlmesh.learner.data.examples import Example, TrainData
    from rlmesh.learner.train.trainer import Trainer
    from rlmesh.services.config import DPOSection, RunConfig, SFTSection


def stage_metrics(config: RunConfig, run_dir: Path, stage: str, name: str) -> MetricsWriter:
    """A writer of `<run_dir>/<name>` (a rerun into the same directory starts it afresh) that also
    hands every record to the trackers in `logging.trackers`, as the run directory's `stage` run
    (TensorBoard `tensorboard/<stage>`, W&B and MLflow run `<run_dir name>-<stage>`): an SFT warm
    start's steps stay apart from the RL steps that follow it."""
    from rlmesh.learner.trackers import build_trackers

    (run_dir / name).unlink(missing_ok=True)
    trackers = build_trackers(config.logging, run_dir, run_dir.name, config.model_dump(mode="json"), stage=stage)
    return MetricsWriter(run_dir, name, trackers=trackers)


def train_offline(trainer: Trainer, examples: TrainData | list[Example], rng: random.Random,
                  section: SFTSection | DPOSection, *,
                  output: Path, tokenizer: Any, source_dir: str, desc: str,
                  postfix: Callable[[dict[str, float]], dict[str, str]], show_progress: bool | None = None,
                  metrics: MetricsWriter | None = None, evaluate: Callable[[int], dict] | None = None,
                  eval_every: int = default(DPOSection, "eval_every")) -> dict | None:
    """`section.num_steps` steps of `section.batch_size` examples drawn (with replacement) from
    `examples` by `rng` (a streamed dataset gives its next rows instead: `TrainData.draw`), at
    `section.lr`; then the model goes to `output`. Returns the final
    evaluation's record (None without `evaluate`)."""
    from tqdm import tqdm

    from rlmesh.learner.data.examples import in_order

    data = in_order(examples)
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    bar = tqdm(range(1, section.num_steps + 1), desc=desc, disable=not show_progress)
    for step in bar:
        seqs = trainer.objective.sequences(data.draw(rng, section.batch_size))
        step_metrics = trainer.step(seqs, offline_lr(section, step))
        if metrics is not None:
            metrics.write({"kind": "train", "step": step, **step_metrics})
        bar.set_postfix(postfix(step_metrics))
        if evaluate is not None and eval_every and step % eval_every == 0 and step < section.num_steps:
            evaluate(step)
    final = evaluate(section.num_steps) if evaluate is not None else None
    save_model(trainer, tokenizer, source_dir, output)
    return final


def offline_lr(section: SFTSection | DPOSection, step: int) -> float:
    """The rate of offline step `step` (1-based): SFT's schedule (`sft.lr_schedule`), DPO's constant rate."""
    from rlmesh.learner.train.schedule import sft_learning_rate
    from rlmesh.services.config import SFTSection

    return sft_learning_rate(section, step) if isinstance(section, SFTSection) else section.lr


def save_model(trainer: Trainer, tokenizer: Any, source_dir: str, output: Path) -> None:
    """The trained weights as an HF model directory, with the tokenizer and the source model's
    generation config (vLLM reads its stop tokens from there)."""
    trainer.save_pretrained(output)
    tokenizer.save_pretrained(str(output))
    gen = Path(source_dir) / "generation_config.json"
    if gen.is_file():
        (output / "generation_config.json").write_text(gen.read_text())
