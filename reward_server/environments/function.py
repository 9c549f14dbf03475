"""A user reward function loaded by import path (`package.module:function`) as an environment.
The function takes (prompt_messages, completion, metadata) and returns a float or a dict with
"reward" and optional components.

Items are scored one per call (`max_batch_size = 1`), so a function that hangs or is slow on one
item times out only that item."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rlmesh.reward_server.environments.base import ScoreInput, ScoreOutput


def load_callable(path: str) -> Callable[..., Any]:
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


class FunctionEnvironment:
    max_batch_size = 1

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.description = f"user reward function {path}"
        self._fn = load_callable(path)

    def score(self, items: list[ScoreInput]) -> list[ScoreOutput]:
        out = []
        for item in items:
            try:
                value = self._fn(item.prompt, item.completion, item.metadata)
            except Exception as err:  # a user function's bug must not take down the batch
                out.append(ScoreOutput(error=f"{self.name}: reward function raised {type(err).__name__}: {err}"))
                continue
            if isinstance(value, dict):
                components = {k: float(v) for k, v in value.items() if k != "reward"}
                out.append(ScoreOutput(reward=float(value.get("reward", 0.0)), components=components))
            elif isinstance(value, (int, float)):
                out.append(ScoreOutput(reward=float(value)))
            else:
                out.append(ScoreOutput(error=f"{self.name}: reward function returned {type(value).__name__}, "
                                             "expected a float or a dict with 'reward'"))
        return out
