"""The reward server's environments: the built-in ones by name, and how an environment a user names by
import path is loaded (a reward function, or a multi-turn environment class). The servicer
(`service.RewardService`) holds the ones a server serves and maps the RPCs onto them."""

from __future__ import annotations

from typing import Any

from rlmesh.reward_server.environments.agent import AgentEnvironment
from rlmesh.reward_server.environments.arithmetic import ArithmeticEnvironment
from rlmesh.reward_server.environments.base import is_multi_turn, load_callable
from rlmesh.reward_server.environments.calculator import CalculatorEnvironment
from rlmesh.reward_server.environments.function import FunctionEnvironment
from rlmesh.reward_server.environments.guess_number import GuessNumberEnvironment
from rlmesh.reward_server.environments.math import MathEnvironment
from rlmesh.reward_server.environments.reasoning_gym import ReasoningGymEnvironment
from rlmesh.reward_server.environments.textarena import TextArenaEnvironment
from rlmesh.reward_server.function_workers import WorkerLimits

BUILTIN = {"arithmetic": ArithmeticEnvironment, "guess_number": GuessNumberEnvironment,
           "calculator": CalculatorEnvironment, "math": MathEnvironment, "reasoning_gym": ReasoningGymEnvironment,
           "textarena": TextArenaEnvironment}


def load_environment(name: str, path: str, function_limits: WorkerLimits) -> Any:
    """`module:function` is a single-turn reward function, run in worker processes under
    `function_limits` (its module is imported there, never in this process); `module:Class` (with
    reset and step) is a multi-turn environment, constructed without arguments in this process."""
    function = FunctionEnvironment(name, path, function_limits)
    if not function.workers.multi_turn:
        return function
    function.close()
    env = load_callable(path)()
    env.name = name
    env.description = getattr(env, "description", "") or f"multi-turn environment {path}"
    return env


def kind_of(env: Any) -> str:
    """How the servicer serves `env`: an agent, a multi-turn environment or single-turn scoring."""
    if isinstance(env, AgentEnvironment):
        return "agent"
    return "multi_turn" if is_multi_turn(env) else "single_turn"
