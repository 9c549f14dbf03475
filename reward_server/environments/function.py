"""A user reward function loaded by import path (`package.module:function`) as an environment.
The function takes (prompt_messages, completion, metadata) and returns a float or a dict with
"reward" and optional components.

Items are scored one per call (`max_batch_size = 1`), so a function that hangs or is slow on one
item times out only that item. The function runs in worker processes with memory and CPU limits and
a clean environment (`rlmesh.reward_server.function_workers`); the server never calls it itself."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rlmesh.reward_server.environments.base import ScoreInput, ScoreOutput
from rlmesh.reward_server.function_workers import FunctionWorkerPool, WorkerLimits


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

    def __init__(self, name: str, path: str, limits: WorkerLimits | None = None) -> None:
        self.name = name
        self.description = f"user reward function {path}"
        self.workers = FunctionWorkerPool(name, path, limits or WorkerLimits())

    def score(self, items: list[ScoreInput], deadline: float | None = None) -> list[ScoreOutput]:
        """`deadline` (`time.monotonic()`): when the caller stops waiting; a worker still on an item
        then is killed (at the latest `reward.env_timeout_s` into the item)."""
        out = []
        for item in items:
            answer = self.workers.call({"prompt": item.prompt, "completion": item.completion,
                                        "metadata": item.metadata}, deadline)
            if "error" in answer:
                out.append(ScoreOutput(error=f"{self.name}: {answer['error']}"))
            else:
                out.append(ScoreOutput(reward=answer["reward"], components=answer.get("components", {})))
        return out

    def close(self) -> None:
        self.workers.close()
