"""Prompt datasets: generated arithmetic problems or JSONL files. An example is a plain dict
{"id", "prompt", "answer", "env"}; the learner turns it into a PromptGroup."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from services.config import ArithmeticDataSection, DataSection, JsonlDataSection


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str
    answer: str
    env: str


def _arithmetic(cfg: ArithmeticDataSection, seed: int) -> tuple[list[Example], list[Example]]:
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    problems = [
        (a, op, b)
        for op in cfg.ops
        for a in range(cfg.max_operand + 1)
        for b in range(cfg.max_operand + 1)
    ]
    random.Random(seed).shuffle(problems)
    if cfg.num_eval >= len(problems):
        raise ValueError(
            f"data.num_eval={cfg.num_eval} leaves no training problems out of {len(problems)} "
            "distinct ones; lower data.num_eval or raise data.max_operand"
        )
    examples = [
        Example(id=f"{a}{op}{b}", prompt=f"{a}{op}{b}=", answer=str(ops[op](a, b)), env="arithmetic")
        for a, op, b in problems
    ]
    eval_set = examples[: cfg.num_eval]
    train = examples[cfg.num_eval :][: cfg.num_train]
    return train, eval_set


def _jsonl(path: str, cfg: JsonlDataSection) -> list[Example]:
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        for key in (cfg.prompt_key, cfg.answer_key):
            if key not in row:
                raise ValueError(f"{path}:{i + 1}: missing field {key!r} (data.prompt_key / data.answer_key)")
        out.append(Example(id=str(row.get("id", i)), prompt=str(row[cfg.prompt_key]),
                           answer=str(row[cfg.answer_key]), env=cfg.env_name))
    return out


def load_dataset(cfg: DataSection, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples."""
    if isinstance(cfg, ArithmeticDataSection):
        return _arithmetic(cfg, seed)
    return _jsonl(cfg.train_path, cfg), _jsonl(cfg.eval_path, cfg)
