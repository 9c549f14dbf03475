"""The environment interfaces the reward server hosts.

- `SingleTurnEnvironment` scores finished completions in batches (`Score`).
- `MultiTurnEnvironment` runs an episode as a session (`Reset`, `Step`, `Close`): reset hands back
  the session's state and the first observation, each step takes the model's assistant message and
  answers with new messages (user or tool role), a step reward, and whether the episode is done.

User code named by import path (`module:attr`: a reward function, an environment class, a scoring
or action function) is loaded with `load_callable`.

Both are plain blocking Python. The reward server runs every call on a bounded pool of worker
threads with a timeout, so an environment needs no locking or asyncio of its own; it must only be
safe to call for different sessions from different threads at once.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# A chat message: "role" and "content", optionally "name" and "tool_call_id" (tool results).
Message = dict[str, str]
# A tool the model may call: an OpenAI-style function schema, as the chat template's `tools=` takes.
ToolSchema = dict[str, Any]


@dataclass
class ScoreInput:
    id: str
    prompt: list[Message]
    completion: str
    metadata: dict[str, Any]


@dataclass
class ScoreOutput:
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    # Set when the item could not be scored at all; such samples are never trained on.
    error: str = ""
    # An agent's reward for each model call it made, in order (per-turn credit); empty otherwise.
    turn_rewards: list[float] = field(default_factory=list)


class ItemError(Exception):
    """Raised by a reward function (in its worker process) to fail its item with exactly this message;
    any other exception's message is prefixed with "reward function raised <type>"."""


class SingleTurnEnvironment(Protocol):
    """Scores batches of completions. An environment may set `max_batch_size` (an int) to have the
    server split batches, e.g. 1 so that one slow item only times out itself."""

    name: str
    description: str

    def score(self, items: list[ScoreInput]) -> list[ScoreOutput]:
        """Score a batch; one output per input, in order. Raising fails only this batch's items."""


@dataclass
class ResetOutput:
    # Whatever the environment keeps per session; the server hands it back to step and close.
    state: Any
    # Messages appended after the prompt before the first generation (often none).
    observation: list[Message] = field(default_factory=list)


@dataclass
class StepOutput:
    observation: list[Message] = field(default_factory=list)
    # Reward of this step; the episode's reward is the sum over its steps.
    reward: float = 0.0
    done: bool = False
    # Episode-level components (e.g. "correct"), reported on the step that ends the episode.
    components: dict[str, float] = field(default_factory=dict)
    # Anything else worth logging (turns taken, why the episode ended); JSON-serialisable.
    metadata: dict[str, Any] = field(default_factory=dict)


class MultiTurnEnvironment(Protocol):
    """An episode as a session. Raise `ValueError` for bad input (metadata, a step after the
    episode ended): the caller gets INVALID_ARGUMENT with the message. Malformed model output is not
    bad input: answer it with an observation the model can read."""

    name: str
    description: str

    def tools(self) -> list[ToolSchema]:
        """The tools this environment offers the model (empty for a game without tools)."""

    def reset(self, metadata: dict[str, Any], prompt: list[Message]) -> ResetOutput:
        """Start an episode for one prompt and its dataset metadata."""

    def step(self, state: Any, action: Message) -> StepOutput:
        """Apply the model's assistant message to the session's state."""

    def close(self, state: Any) -> None:
        """Release what the session holds. Called once, also for episodes that did not finish, and
        then possibly while a step of the session that missed its timeout still runs."""


def is_multi_turn(env: object) -> bool:
    return callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))


def nonfinite_error(reward: float, components: Mapping[str, float]) -> str:
    """Why a reward cannot be trained on (NaN or infinite value), or "" if it can."""
    if not math.isfinite(reward):
        return f"reward is {reward}; rewards must be finite"
    bad = sorted(k for k, v in components.items() if not math.isfinite(v))
    return f"reward component(s) {', '.join(bad)} not finite; components must be finite" if bad else ""


def load_callable(path: str) -> Callable[..., Any]:
    """The object `module:attr` names, imported in this process."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward function {path!r}: cannot import {module_name!r} ({err})") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {path!r}: {module_name!r} has no callable {attr!r}")
    return fn
