"""`rlmesh dpo`: direct preference optimisation on (prompt, chosen, rejected) pairs, offline, through
the same trainer, backend and step as RL and SFT (the objective: `learner/train/objectives/dpo.py`),
on the offline loop it shares with SFT (`learner/recipes/offline.py`).

The reference policy is the starting model (after the SFT warm start when `sft.num_steps > 0`): its
token logprobs of every train and held-out pair are computed once, before the first step, with the
training backend's own no-grad forward, so at step 0 every implicit reward is exactly zero. Writes:

    <output>/
      sft_model/       the warm start (only with sft.num_steps > 0)
      model/           the DPO policy (HF model directory, tokenizer included)
      metrics.jsonl    one line per step (loss, reward accuracy and margin, chosen / rejected reward)
                       and per held-out evaluation; also in the trackers `logging.trackers` names,
                       as the `dpo` stage (the warm start's steps: `sft_metrics.jsonl`, `sft` stage)
      summary.json     held-out preference accuracy and greedy match before -> after
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rlmesh.learner.train.batch import MicroBatch, Sequence, plan_step
from rlmesh.learner.data.sources import load_dataset
from rlmesh.learner.data.examples import Example, TrainOrder
from rlmesh.learner.recipes.offline import stage_metrics, train_offline
from rlmesh.learner.recipes.sft import prepare_model, run_sft
from rlmesh.services.domain.chat import make_codec

if TYPE_CHECKING:
    import torch

    from rlmesh.learner.train.trainer import Trainer
    from rlmesh.services.config import PromptSection, RunConfig

log = logging.getLogger(__name__)


def preference_pairs(examples: list[Example], split: str) -> list[Example]:
    pairs = [ex for ex in examples if ex.chosen is not None and ex.rejected is not None]
    if not pairs:
        raise ValueError(f"the {split} data has no preference pairs: give each row a chosen and a rejected "
                         "assistant turn (data.chosen_key / data.rejected_key), or use data.type=arithmetic")
    return pairs


def scored_chunks(trainer: Trainer, seqs: list[Sequence], micro_batch_size: int, pad_id: int
                  ) -> Iterator[tuple[list[Sequence], MicroBatch, torch.Tensor]]:
    """(sequences, their micro-batch, the current policy's token logprobs) in no-grad chunks; an even
    `micro_batch_size` keeps each pair in one chunk."""
    for start in range(0, len(seqs), micro_batch_size):
        chunk = seqs[start : start + micro_batch_size]
        (micro,) = plan_step(chunk, len(chunk), pad_id)
        yield chunk, micro, trainer.backend.compute_logprobs(micro)


def attach_reference(trainer: Trainer, seqs: list[Sequence], micro_batch_size: int, pad_id: int) -> None:
    """Store the current (reference) policy's token logprobs of each response in the sequence's
    `behaviour_logprobs`, where the DPO loss reads them."""
    for chunk, _, logprobs_BT in scored_chunks(trainer, seqs, micro_batch_size, pad_id):
        for row, s in enumerate(chunk):
            at = len(s.prompt_ids) - 1  # target position of the first response token
            s.behaviour_logprobs = logprobs_BT[row, at : at + len(s.completion_ids)].tolist()


def preference_accuracy(trainer: Trainer, pairs: list[tuple[Sequence, Sequence]], beta: float, micro_batch_size: int,
                        pad_id: int) -> dict[str, float]:
    """Held-out: how often the policy's implicit reward ranks chosen above rejected, and the mean margin."""
    from rlmesh.learner.train.objectives.dpo import dpo_loss

    seqs = [s for pair in pairs for s in pair]
    wins, margin, n = 0.0, 0.0, 0
    for chunk, micro, logprobs_BT in scored_chunks(trainer, seqs, micro_batch_size, pad_id):
        _, m = dpo_loss(logprobs_BT, micro, beta)
        k = len(chunk) // 2
        wins, margin, n = wins + m["reward_accuracy"] * k, margin + m["reward_margin"] * k, n + k
    return {"preference_accuracy": wins / n, "reward_margin": margin / n}


def greedy_match(model_dir: Path | str, examples: list[Example], max_tokens: int,
                 prompt: PromptSection | None = None) -> float:
    """Fraction of held-out prompts whose greedy completion (HF `generate`) is exactly the chosen
    response: for the arithmetic pairs, held-out accuracy."""
    from rlmesh.learner.recipes.greedy import greedy_completions

    texts = greedy_completions(model_dir, examples, max_tokens, prompt=prompt)
    return sum(text == ex.chosen for text, ex in zip(texts, examples)) / len(examples)


def run_dpo(config: RunConfig, output: str | Path, *, show_progress: bool | None = None) -> dict:
    from transformers import AutoTokenizer

    from rlmesh.learner.train.objectives.dpo import DPOObjective
    from rlmesh.learner.train.trainer import Trainer

    cfg = config.dpo
    output = Path(output)
    if config.learner.micro_batch_size % 2:
        raise ValueError(f"learner.micro_batch_size={config.learner.micro_batch_size}: DPO keeps each (chosen, rejected) "
                         "pair in one micro-batch, so it must be even")
    train_data, eval_set = load_dataset(config.data, config.run.seed, config.reward)
    if not isinstance(train_data, TrainOrder):
        raise ValueError("rlmesh dpo computes the reference logprobs of every training pair before its first step, "
                         "so it needs the pairs in memory: set data.streaming=false")
    train_set, eval_set = preference_pairs(list(train_data), "train"), preference_pairs(eval_set, "held-out")
    output.mkdir(parents=True, exist_ok=True)  # once the config and the pairs are known to fit
    if config.sft.num_steps > 0:
        model_dir = str(run_sft(config, output / "sft_model", show_progress=show_progress))
    else:
        model_dir = prepare_model(config, output)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id
    objective = DPOObjective(make_codec(tokenizer, config.prompt), cfg.beta, cfg.sft_weight)
    trainer = Trainer(config, model_dir, objective, lr=cfg.lr, pad_id=pad_id)
    mbs = config.learner.micro_batch_size
    t0 = time.monotonic()
    attach_reference(trainer, objective.sequences(train_set + eval_set), mbs, pad_id)
    log.info("reference logprobs of %d pairs computed in %.1fs", len(train_set) + len(eval_set),
             time.monotonic() - t0)
    held_out = [objective.pair(ex) for ex in eval_set]
    max_tokens = max(len(s.completion_ids) for pair in held_out for s in pair)

    metrics = stage_metrics(config, output, "dpo", "metrics.jsonl")

    def evaluate(step: int) -> dict:
        record = {"kind": "eval", "step": step, **preference_accuracy(trainer, held_out, cfg.beta, mbs, pad_id)}
        metrics.write(record)
        return record

    before = {**evaluate(0), "greedy_match": greedy_match(model_dir, eval_set, max_tokens, config.prompt)}
    log.info("before DPO: held-out preference accuracy %.2f, greedy match %.2f",
             before["preference_accuracy"], before["greedy_match"])
    after = train_offline(trainer, train_set, random.Random(config.run.seed), cfg, output=output / "model",
                          tokenizer=tokenizer, source_dir=model_dir, desc="dpo", show_progress=show_progress,
                          postfix=lambda m: {"loss": f"{m['loss']:.3f}", "acc": f"{m['reward_accuracy']:.2f}"},
                          metrics=metrics, evaluate=evaluate, eval_every=cfg.eval_every)
    metrics.close()
    assert after is not None
    after["greedy_match"] = greedy_match(output / "model", eval_set, max_tokens, config.prompt)
    summary = {"num_steps": cfg.num_steps, "beta": cfg.beta, "num_train_pairs": len(train_set),
               "num_eval_pairs": len(eval_set), "before": before, "after": after, "model": str(output / "model")}
    (output / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("after DPO: held-out preference accuracy %.2f, greedy match %.2f; model in %s",
             after["preference_accuracy"], after["greedy_match"], output / "model")
    return summary


def main(config: RunConfig, args: argparse.Namespace) -> int:
    from rlmesh.services.telemetry import setup_logging

    setup_logging("dpo", config.logging.level)
    if config.dpo.num_steps == 0:
        raise SystemExit("rlmesh dpo: dpo.num_steps is 0; pass dpo.num_steps=N")
    try:
        summary = run_dpo(config, args.output)
    except ValueError as err:
        raise SystemExit(f"rlmesh dpo: {err}") from err
    b, a = summary["before"], summary["after"]
    print(f"held-out preference accuracy {b['preference_accuracy']:.2f} -> {a['preference_accuracy']:.2f}; "
          f"greedy completion == chosen {b['greedy_match']:.2f} -> {a['greedy_match']:.2f}")
    print(f"DPO model: {summary['model']}")
    return 0
