"""`rlmesh sft`: supervised fine-tuning (masked NLL on assistant tokens) through the same trainer,
backend and step as RL, with the SFT objective. The demo uses it as a warm start so the policy
begins with some reward to improve on."""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

from rlmesh.learner.train.batch import Sequence
from rlmesh.learner.data import Example, load_dataset
from rlmesh.domain.chat import ChatCodec
from rlmesh.services.config import HFModelSection, RunConfig

log = logging.getLogger(__name__)


def prepare_model(config: RunConfig, workdir: Path) -> str:
    """Path of an HF model directory for `config.model`, writing the tiny model if asked for."""
    if isinstance(config.model, HFModelSection):
        return config.model.path
    from rlmesh.learner.devtools.tiny_model import write_tiny_model

    return str(write_tiny_model(config.model, workdir / "init_model", seed=config.run.seed))


def sft_target(example: Example, rng: random.Random, label_noise: float) -> str:
    """The assistant turn to imitate. With probability `label_noise` a stray "!" follows the answer
    ("7!", which the exact-answer checker scores 0): the warm start learns the arithmetic from every
    example but also a habit of not stopping after the answer, which the demo's RL stage unlearns."""
    reference = example.reference
    if reference is None:
        raise ValueError(f"example {example.id!r} has no reference answer for SFT: give it a trailing assistant "
                         "message or metadata.answer")
    if label_noise and rng.random() < label_noise:
        return reference + "!"
    return reference


def sft_conversation(example: Example, rng: random.Random, label_noise: float) -> list[dict[str, str]]:
    """A multi-turn demonstration to imitate. With probability `label_noise` the example's shortcut
    instead (the calculator's: answer at once, without the tool, repeating the first number): the
    warm start takes the shortcut most of the time, and RL has to learn that the tool pays."""
    if label_noise and example.shortcut and rng.random() < label_noise:
        return example.shortcut
    return example.demonstration


def sft_sequence(example: Example, codec: ChatCodec, rng: random.Random, label_noise: float,
                 prompt_cache: dict[str, list[int]]) -> Sequence:
    if example.demonstration:
        prompt, completion, mask = codec.conversation(sft_conversation(example, rng, label_noise), example.tools)
        return Sequence(prompt, completion, mask)
    if example.id not in prompt_cache:
        prompt_cache[example.id] = codec.prompt(example.prompt_messages, example.tools)
    target = codec.tokenizer.encode(sft_target(example, rng, label_noise), add_special_tokens=False) + [codec.eos_id]
    return Sequence(prompt_cache[example.id], target, [True] * len(target))


def run_sft(config: RunConfig, output: str | Path, *, show_progress: bool | None = None) -> Path:
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from rlmesh.learner.train.trainer import Trainer

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(config.learner.torch_threads)
    model_dir = prepare_model(config, output.parent)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = Trainer(config, model_dir, "sft", lr=config.sft.lr, pad_id=tokenizer.pad_token_id)
    train, _ = load_dataset(config.data, config.run.seed)
    rng = random.Random(config.run.seed)
    codec = ChatCodec(tokenizer)
    prompt_cache: dict[str, list[int]] = {}
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    bar = tqdm(range(config.sft.num_steps), desc="sft", disable=not show_progress)
    for _ in bar:
        seqs = [sft_sequence(ex, codec, rng, config.sft.label_noise, prompt_cache)
                for ex in rng.choices(train, k=config.sft.batch_size)]
        metrics = trainer.step(seqs, config.sft.lr)
        bar.set_postfix(nll=f"{metrics['nll']:.3f}")
    trainer.save_pretrained(output)
    tokenizer.save_pretrained(str(output))
    _copy_generation_config(model_dir, output)
    log.info("SFT model written to %s", output)
    return output


def _copy_generation_config(src: str, dst: Path) -> None:
    gen = Path(src) / "generation_config.json"
    if gen.is_file():
        (dst / "generation_config.json").write_text(gen.read_text())


def main(config: RunConfig, args: argparse.Namespace) -> int:
    from rlmesh.services.telemetry import setup_logging

    setup_logging("sft", config.logging.level)
    if config.sft.num_steps == 0:
        raise SystemExit("rlmesh sft: sft.num_steps is 0; pass sft.num_steps=N")
    run_sft(config, args.output)
    return 0
