"""Guess the number: a short multi-turn game without tools.

The environment holds a secret integer in [low, high]; each turn the model guesses, and the answer
is "higher", "lower" or "correct". The episode ends when the model is right (reward 1, `correct` 1)
or after `max_turns` guesses (reward 0). A turn without a number costs a turn and is answered with
a hint, so a model that rambles learns from its reward, never from a crash.

Metadata (all optional): `secret`, `low` (1), `high` (16), `max_turns` (5), `seed` (picks the
secret when `secret` is absent; without either, the environment's own seeded generator does).
Components, on the step that ends the episode: `correct`, `turns` (guesses taken).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any

from rlmesh.services.domain.scoring import as_int, first_integer
from rlmesh.reward_server.environments.base import Message, ResetOutput, StepOutput, ToolSchema


@dataclass
class GuessState:
    secret: int
    low: int
    high: int
    max_turns: int
    turns: int = 0
    done: bool = False


def _int_field(metadata: dict[str, Any], key: str, default: int) -> int:
    value = as_int(metadata.get(key, default))
    if value is None:
        raise ValueError(f"guess_number: metadata.{key}={metadata[key]!r} is not an integer")
    return value


class GuessNumberEnvironment:
    name = "guess_number"
    description = "guess a secret integer in [low, high] with higher/lower feedback; reward 1 when guessed"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()  # sessions reset from several worker threads

    def tools(self) -> list[ToolSchema]:
        return []

    def reset(self, metadata: dict[str, Any], prompt: list[Message]) -> ResetOutput:
        low, high = _int_field(metadata, "low", 1), _int_field(metadata, "high", 16)
        max_turns = _int_field(metadata, "max_turns", 5)
        if low > high or max_turns < 1:
            raise ValueError(f"guess_number: need low <= high and max_turns >= 1, got low={low}, high={high}, "
                             f"max_turns={max_turns}")
        if "secret" in metadata:
            secret = _int_field(metadata, "secret", 0)
            if not low <= secret <= high:
                raise ValueError(f"guess_number: metadata.secret={secret} is outside [{low}, {high}]")
        elif "seed" in metadata:
            secret = random.Random(_int_field(metadata, "seed", 0)).randint(low, high)
        else:
            with self._rng_lock:
                secret = self._rng.randint(low, high)
        state = GuessState(secret, low, high, max_turns)
        # A dataset prompt already states the game; an empty one gets the rules as the first message.
        observation = [] if prompt else [{"role": "user", "content": self.rules(state)}]
        return ResetOutput(state, observation)

    @staticmethod
    def rules(state: GuessState) -> str:
        return (f"I picked an integer between {state.low} and {state.high}. Guess it: answer with one number. "
                f"I will say higher or lower. You have {state.max_turns} guesses.")

    def step(self, state: GuessState, action: Message) -> StepOutput:
        if state.done:
            raise ValueError("guess_number: the episode is over; close the session")
        state.turns += 1
        guess = first_integer(action.get("content", ""))
        if guess is None:
            feedback = (f"I found no number in your answer. Answer with one integer between {state.low} and "
                        f"{state.high}.")
        elif guess == state.secret:
            state.done = True
            return StepOutput([{"role": "user", "content": "correct"}], reward=1.0, done=True,
                              components={"correct": 1.0, "turns": float(state.turns)},
                              metadata={"turns": state.turns, "secret": state.secret, "end": "guessed"})
        else:
            feedback = "higher" if state.secret > guess else "lower"
        if state.turns >= state.max_turns:
            state.done = True
            return StepOutput([{"role": "user", "content": f"{feedback}. Out of guesses; it was {state.secret}."}],
                              reward=0.0, done=True, components={"correct": 0.0, "turns": float(state.turns)},
                              metadata={"turns": state.turns, "secret": state.secret, "end": "max_turns"})
        return StepOutput([{"role": "user", "content": feedback}], metadata={"turns": state.turns})

    def close(self, state: GuessState) -> None:
        state.done = True
