"""`rlmesh sft`: supervised fine-tuning (masked NLL on assistant tokens, `rlmesh.learner.train.
objectives.sft`) through the same trainer, backend and step as RL, on the offline loop it shares
with DPO. The demo uses it as a warm start so the policy begins with some reward to improve on.
Its step metrics go to `sft_metrics.jsonl` next to the output directory (in `rlmesh up`, the run
directory) and to the trackers `logging.trackers` names, as the run's `sft` stage."""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

from rlmesh.learner.data.sources import load_dataset
from rlmesh.learner.recipes.offline import stage_metrics, train_offline
from rlmesh.services.domain.chat import make_codec
from rlmesh.services.config import HFModelSection, LoRASection, RunConfig

log = logging.getLogger(__name__)


def prepare_model(config: RunConfig, workdir: Path) -> str:
    """Path of an HF model directory for `config.model`, writing the tiny model if asked for."""
    if isinstance(config.model, HFModelSection):
        return config.model.path
    from rlmesh.learner.devtools.tiny_model import write_tiny_model

    return str(write_tiny_model(config.model, workdir / "init_model", seed=config.run.seed))


def run_sft(config: RunConfig, output: str | Path, *, show_progress: bool | None = None) -> Path:
    from transformers import AutoTokenizer

    from rlmesh.learner.train.objectives.sft import SFTObjective
    from rlmesh.learner.train.trainer import Trainer

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(config, output.parent)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(config.run.seed)
    objective = SFTObjective(make_codec(tokenizer, config.prompt), rng, config.sft.label_noise)
    # The warm start makes the model that RL then adapts: every weight trains, whatever learner.lora says.
    full = config.model_copy(update={"learner": config.learner.model_copy(update={"lora": LoRASection()})})
    trainer = Trainer(full, model_dir, objective, lr=config.sft.lr, pad_id=tokenizer.pad_token_id,
                      threads=config.sft.torch_threads)
    train, _ = load_dataset(config.data, config.run.seed, config.reward)
    metrics = stage_metrics(config, output.parent, "sft", "sft_metrics.jsonl")
    try:
        train_offline(trainer, train, rng, config.sft, output=output, tokenizer=tokenizer, source_dir=model_dir,
                      desc="sft", postfix=lambda m: {"nll": f"{m['nll']:.3f}"}, show_progress=show_progress,
                      metrics=metrics)
    finally:
        metrics.close()
    log.info("SFT model written to %s", output)
    return output


def main(config: RunConfig, args: argparse.Namespace) -> int:
    from rlmesh.services.telemetry import setup_logging

    setup_logging("sft", config.logging.level)
    if config.sft.num_steps == 0:
        raise SystemExit("rlmesh sft: sft.num_steps is 0; pass sft.num_steps=N")
    run_sft(config, args.output)
    return 0
