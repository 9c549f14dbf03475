"""The task both sides of a comparison train on (bench/trl_vs_rlmesh.py, bench/trl_side.py,
bench/long_generation.py): the default config, and the environment that scores it, built in this process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "arithmetic_grpo.yaml"
EVERY = 10  # checkpoint (and evaluation) interval in steps on both sides where the config sets none

if TYPE_CHECKING:
    from rlmesh.services.config import RunConfig


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def environment(config: RunConfig) -> Any:
    """The environment scoring `data.env_name`, built in this process as the reward server builds it:
    `math` with its reward.math settings, another built-in, or a reward.functions entry."""
    from rlmesh.reward_server.function_workers import WorkerLimits
    from rlmesh.reward_server.environments.math import MathEnvironment
    from rlmesh.reward_server.registry import BUILTIN, load_environment

    name = config.data.env_name
    if name == "math":
        return MathEnvironment(**config.reward.math.model_dump())
    if name in config.reward.functions:
        return load_environment(name, config.reward.functions[name], WorkerLimits.from_config(config.reward))
    if name in BUILTIN:
        return BUILTIN[name]()
    raise ValueError(f"data.env_name={name!r}: this bench scores in-process with a built-in environment "
                     f"({', '.join(BUILTIN)}) or a reward.functions entry; remote environments are not supported")


def score(env: Any, completions: list[str], answers: list[Any]) -> tuple[list[float], list[float]]:
    """(reward, correct) of each completion by `env`; `correct` is the component of that name, else the reward."""
    from rlmesh.reward_server.environments.base import ScoreInput

    outs = env.score([ScoreInput(id=str(i), prompt=[], completion=c, metadata={"answer": a})
                      for i, (c, a) in enumerate(zip(completions, answers))])
    assert not any(o.error for o in outs), [o.error for o in outs if o.error]
    return [o.reward for o in outs], [o.components.get("correct", o.reward) for o in outs]
