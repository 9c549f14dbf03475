"""A small OpenEnv environment server for the tests: guess a number with higher/lower feedback.
Run as `python -m tests.integration.openenv_guess PORT`. A guess of `sleep` (a stand-in for a slow
environment) sleeps for 30 seconds; `raise` makes the step fail."""

from __future__ import annotations

import random
import re
import sys
import time

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state, self._target = State(), 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, target: int | None = None,
              **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self._target = target if target is not None else random.Random(seed).randint(1, 100)
        return GuessObservation(feedback="I picked a number from 1 to 100. Guess it.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if action.message.strip() == "sleep":
            time.sleep(30)
        if action.message.strip() == "raise":
            raise RuntimeError("the guessing game exploded")
        found = re.search(r"-?\d+", action.message)
        if found is None:
            return GuessObservation(feedback="Say a number.", reward=0.0)
        guess = int(found.group())
        if guess == self._target:
            return GuessObservation(feedback="Correct!", reward=1.0, done=True)
        return GuessObservation(feedback="Higher." if guess < self._target else "Lower.", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=64)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
