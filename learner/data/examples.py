"""What a prompt dataset holds, whichever kind loaded it (`rlmesh.learner.data.sources`,
`rlmesh.learner.data.hf`): an `Example` carries the chat messages to send and an opaque metadata
dict for its environment (the learner never looks inside). Training examples are read in one order
given by a cursor (`TrainData.at`), so a cursor saved in a checkpoint resumes exactly."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


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


def assistant_turn(value: Any, where: str) -> str:
    """A preference side as text: a plain string, or TRL's conversational form (a list of messages
    whose last one is the assistant's)."""
    if isinstance(value, str):
        return value
    if (isinstance(value, list) and value and isinstance(value[-1], dict)
            and value[-1].get("role") == "assistant" and isinstance(value[-1].get("content"), str)):
        return value[-1]["content"]
    raise ValueError(f"{where} must be a string or a list of messages ending in an assistant message")
