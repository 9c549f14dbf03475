"""A user reward function loaded by import path (`package.module:function`) as an environment.
The function takes (prompt_messages, completion, metadata) and returns a float or a dict with
"reward" and optional components.

Items are scored one per call (`max_batch_size = 1`), so a function that hangs or is slow on one
item times out only that item. The function runs in worker processes with memory and CPU limits and
a clean environment (`rlmesh.reward_server.function_workers`); the server never calls it itself."""

from __future__ import annotations

from rlmesh.reward_server.environments.base import ScoreInput, ScoreOutput
from rlmesh.reward_server.function_workers import FunctionWorkerPool, WorkerLimits
from rlmesh.services.config import RewardSection


class FunctionEnvironment:
    max_batch_size = 1

    def __init__(self, name: str, path: str, limits: WorkerLimits | None = None) -> None:
        self.name = name
        self.description = f"user reward function {path}"
        self.workers = FunctionWorkerPool(name, path, limits or WorkerLimits.from_config(RewardSection()))

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

    def healthy(self) -> str:
        """Why this function cannot answer now, or "" (the reward server's per-function health)."""
        return self.workers.healthy()

    def close(self) -> None:
        self.workers.close()
