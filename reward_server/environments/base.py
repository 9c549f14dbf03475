"""The environment interface the reward server hosts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ScoreInput:
    id: str
    prompt: list[dict[str, str]]
    completion: str
    metadata: dict[str, Any]


@dataclass
class ScoreOutput:
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    # Set when the item could not be scored at all; such samples are never trained on.
    error: str = ""


class SingleTurnEnvironment(Protocol):
    name: str
    description: str

    def score(self, items: list[ScoreInput]) -> list[ScoreOutput]:
        """Score a batch; one output per input, in order. Raising fails only this batch's items."""
