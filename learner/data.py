"""Prompt datasets: generated arithmetic problems, JSONL files, or anything Hugging Face `datasets`
reads (`rlmesh.learner.hf_data`). An example carries the chat messages to send and an opaque
metadata dict for its environment (the learner never looks inside). Training examples are read in
one order given by a cursor (`TrainData.at`), so a cursor saved in a checkpoint resumes exactly."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlmesh.services.config import (ArithmeticDataSection, CalculatorDataSection, DataSection, HFDataSection,
                                    JsonlDataSection)
from rlmesh.domain.tasks import ADD_TOOL, calculator_prompt


@dataclass(frozen=True)
class Example:
    id: str
    messages: list[dict[str, str]]
    """The conversation so far (system / user / earlier turns); the policy writes the next turn."""
    env: str
    """Environment that scores it."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Passed to the environment as is (e.g. {"answer": "7"})."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """Tools the environment offers (function schemas); SFT renders them as the episode will."""
    demonstration: list[dict[str, str]] = field(default_factory=list)
    """For SFT: a whole conversation to imitate (assistant turns learned, tool results not); empty for single-turn data."""
    shortcut: list[dict[str, str]] = field(default_factory=list)
    """For SFT label noise: a plausible wrong conversation imitated instead of `demonstration` (e.g. answering without the tool)."""
    chosen: str | None = None
    """For DPO: the preferred assistant turn."""
    rejected: str | None = None
    """For DPO: the dispreferred assistant turn."""

    @property
    def reference(self) -> str | None:
        """A reference assistant turn, for SFT: the metadata's answer, or a trailing assistant message."""
        if self.messages and self.messages[-1].get("role") == "assistant":
            return self.messages[-1]["content"]
        answer = self.metadata.get("answer")
        return None if answer is None else str(answer)

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        """The messages up to (not including) a trailing reference assistant turn."""
        if self.messages and self.messages[-1].get("role") == "assistant":
            return self.messages[:-1]
        return self.messages


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
    examples = []
    for a, op, b in problems:
        answer = str(ops[op](a, b))
        # One preference pair per problem for `rlmesh dpo`: the answer over the answer with the
        # stray "!" the demo's noisy warm start learns (the habit GRPO unlearns in the demo).
        examples.append(Example(id=f"{a}{op}{b}", messages=[{"role": "user", "content": f"{a}{op}{b}="}],
                                env=cfg.env_name, metadata={"answer": answer}, chosen=answer, rejected=f"{answer}!"))
    eval_set = examples[: cfg.num_eval]
    train = examples[cfg.num_eval :][: cfg.num_train]
    return train, eval_set


def _calculator(cfg: CalculatorDataSection, seed: int) -> tuple[list[Example], list[Example]]:
    """Tool-use problems: two operands too large for a tiny model to add in its weights. Each example
    carries the `add` tool and a demonstration (call the tool, read its result, answer)."""
    rng = random.Random(seed)
    span = cfg.max_operand - cfg.min_operand + 1
    if span * span < cfg.num_train + cfg.num_eval:
        raise ValueError(f"data: [{cfg.min_operand}, {cfg.max_operand}] gives {span * span} operand pairs, fewer than "
                         f"num_train + num_eval = {cfg.num_train + cfg.num_eval}; widen the range")
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < cfg.num_train + cfg.num_eval:
        pairs.add((rng.randint(cfg.min_operand, cfg.max_operand), rng.randint(cfg.min_operand, cfg.max_operand)))
    ordered = sorted(pairs)
    rng.shuffle(ordered)
    examples = []
    for a, b in ordered:
        prompt = [{"role": "user", "content": calculator_prompt(a, b)}]
        call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
        demonstration = [*prompt, {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                         {"role": "tool", "name": "add", "content": str(a + b)},
                         {"role": "assistant", "content": str(a + b)}]
        # The shortcut answers at once, repeating the first number: wrong, and one definite habit
        # (not a spread of guesses), so that it can be the warm start's greedy choice.
        examples.append(Example(id=f"{a}+{b}", messages=prompt, env=cfg.env_name,
                                metadata={"answer": a + b, "a": a, "b": b}, tools=[ADD_TOOL],
                                demonstration=demonstration, shortcut=[*prompt, {"role": "assistant", "content": str(a)}]))
    return examples[cfg.num_eval:], examples[: cfg.num_eval]


def _jsonl(path: str, cfg: JsonlDataSection) -> list[Example]:
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        row = json.loads(line)
        if not isinstance(row, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        if cfg.messages_key in row:
            messages = row[cfg.messages_key]
            if not (isinstance(messages, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                       for m in messages)):
                raise ValueError(f"{where}: {cfg.messages_key!r} must be a list of {{role, content}} objects")
        elif cfg.prompt_key in row:
            messages = [{"role": "user", "content": str(row[cfg.prompt_key])}]
        else:
            raise ValueError(f"{where}: needs {cfg.messages_key!r} (chat messages) or {cfg.prompt_key!r} "
                             "(data.messages_key / data.prompt_key)")
        if isinstance(row.get(cfg.metadata_key), dict):
            metadata = dict(row[cfg.metadata_key])
        else:
            metadata = {k: v for k, v in row.items() if k not in ("id", cfg.messages_key, cfg.prompt_key, "env")}
        if cfg.answer_key != "answer" and cfg.answer_key in row:
            metadata.setdefault("answer", row[cfg.answer_key])
        pair = {key: assistant_turn(row[name], f"{where}: {name!r}") if name in row else None
                for key, name in (("chosen", cfg.chosen_key), ("rejected", cfg.rejected_key))}
        for name in (cfg.chosen_key, cfg.rejected_key):
            metadata.pop(name, None)
        out.append(Example(id=str(row.get("id", i)), messages=messages, env=str(row.get("env", cfg.env_name)),
                           metadata=metadata, **pair))
    return out


def assistant_turn(value: Any, where: str) -> str:
    """A preference side as text: a plain string, or TRL's conversational form (a list of messages
    whose last one is the assistant's)."""
    if isinstance(value, str):
        return value
    if (isinstance(value, list) and value and isinstance(value[-1], dict)
            and value[-1].get("role") == "assistant" and isinstance(value[-1].get("content"), str)):
        return value[-1]["content"]
    raise ValueError(f"{where} must be a string or a list of messages ending in an assistant message")


@runtime_checkable
class TrainData(Protocol):
    """Training examples as the learner and the offline recipes read them."""

    def at(self, cursor: int) -> Example:
        """The `cursor`-th example issued (0, 1, 2, ... across epochs)."""

    def draw(self, rng: random.Random, k: int) -> list[Example]:
        """A batch for an offline recipe (SFT): drawn with replacement from an in-memory set; a
        stream gives its next k rows."""


class TrainOrder(Sequence[Example]):
    """In-memory training examples, issued epoch after epoch; with `shuffle` each epoch is a new
    permutation seeded by (seed, epoch), so the order depends on the cursor alone."""

    def __init__(self, examples: list[Example], seed: int = 0, shuffle: bool = False) -> None:
        self.examples, self.seed, self.shuffle = examples, seed, shuffle
        self._epoch, self._order = -1, list(range(len(examples)))

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i):  # type: ignore[override]
        return self.examples[i]

    def at(self, cursor: int) -> Example:
        if not self.examples:
            raise ValueError("the training data has no examples; check data.* (files, split, num_train)")
        epoch, i = divmod(cursor, len(self.examples))
        if not self.shuffle:
            return self.examples[i]
        if epoch != self._epoch:
            self._epoch, self._order = epoch, list(range(len(self.examples)))
            random.Random(f"{self.seed}/epoch/{epoch}").shuffle(self._order)
        return self.examples[self._order[i]]

    def draw(self, rng: random.Random, k: int) -> list[Example]:
        return rng.choices(self.examples, k=k)


def in_order(train: TrainData | list[Example]) -> TrainData:
    """`train` as TrainData; a plain list is issued in its own order, round after round."""
    return train if isinstance(train, TrainData) else TrainOrder(list(train))


def load_dataset(cfg: DataSection, seed: int) -> tuple[TrainData, list[Example]]:
    """(train, eval) examples; the built-in kinds and JSONL files keep their order (a TrainOrder
    without shuffling), `data.type: hf` shuffles per epoch unless `data.shuffle=false`."""
    if isinstance(cfg, HFDataSection):
        from rlmesh.learner.hf_data import load_hf

        return load_hf(cfg, seed)
    if isinstance(cfg, ArithmeticDataSection):
        train, evals = _arithmetic(cfg, seed)
    elif isinstance(cfg, CalculatorDataSection):
        train, evals = _calculator(cfg, seed)
    else:
        train, evals = _jsonl(cfg.train_path, cfg), _jsonl(cfg.eval_path, cfg)
    return TrainOrder(train), evals
