"""Environments written for the classic `verifiers` API (0.3) as their authors write them, for
tests/integration/test_verifiers.py. They run in the test's own virtualenv (verifiers beside rlmesh's
runtime), loaded as `verifiers.load_environment("tests.integration.verifiers_envs", kind=...)`:
a game that answers higher or lower (`guess`; `digits` rewards saying numbers at all, which a random
policy varies on), a tool environment (`tools`) and environments that
go wrong (`broken`, with `mode` raise, hang, hog or nan). `refuse_env` names variables whose presence
fails the load, `require_env` variables whose absence does, `memory_mb` (digits) the address-space limit
each episode checks it runs under."""

from __future__ import annotations

import asyncio
import os
import re
import resource

import verifiers as vf
from datasets import Dataset


class HigherLower(vf.MultiTurnEnv):
    """Guess a number from 1 to 9; the environment says higher or lower, and "Correct!" ends it.
    With `memory_mb`, every episode first checks that it runs under that address-space limit."""

    def __init__(self, memory_mb: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.memory_mb = memory_mb

    async def setup_state(self, state):
        if self.memory_mb is not None:
            limit = resource.getrlimit(resource.RLIMIT_AS)[0]
            if limit != self.memory_mb << 20:
                raise RuntimeError(f"the environment server's address-space limit is {limit}, not {self.memory_mb} MiB")
        state["guesses"] = 0
        return state

    async def env_response(self, messages, state, **kwargs):
        target = int(state["answer"])
        said = re.search(r"\d+", messages[-1].content or "")
        state["guesses"] += 1
        if said and int(said.group()) == target:
            state["final_env_response"] = [vf.UserMessage(content="Correct!")]
            return state["final_env_response"]
        hint = "say a number" if not said else ("higher" if int(said.group()) < target else "lower")
        return [vf.UserMessage(content=hint)]


class Broken(HigherLower):
    """An environment whose turn raises (`mode=raise`), hangs (`mode=hang`), allocates 8 GiB
    (`mode=hog`) or whose rubric gives a reward that is not a number (`mode=nan`)."""

    def __init__(self, mode: str, **kwargs):
        super().__init__(**kwargs)
        self.mode = mode

    async def env_response(self, messages, state, **kwargs):
        if self.mode == "raise":
            raise KeyError("the environment's own bug")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "hog":  # past the environment server's address-space limit (`rlmesh reward --memory-mb`)
            self.hoard = bytearray(8 << 30)
        return await super().env_response(messages, state, **kwargs)


def guessed(completion, **kwargs) -> float:
    return float(any(getattr(m, "content", "") == "Correct!" for m in completion))


def few_guesses(state, **kwargs) -> float:
    return 1.0 / max(1, state["guesses"])


def digits_said(completion, **kwargs) -> float:
    """The share of the policy's messages with a digit in them (a reward a random policy varies on)."""
    said = [m for m in completion if getattr(m, "role", "") == "assistant"]
    return sum(bool(re.search(r"\d", m.content or "")) for m in said) / max(1, len(said))


def not_a_number(**kwargs) -> float:
    return float("nan")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def said_sum(completion, answer, **kwargs) -> float:
    return float(answer in (completion[-1].content or ""))


def _guess_rows(n: int) -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": "Guess my number from 1 to 9."}],
                               "answer": str(1 + i % 9)} for i in range(n)])


def load_environment(kind: str = "guess", mode: str = "raise", max_turns: int = 4, refuse_env: tuple = (),
                     memory_mb: int | None = None, require_env: tuple = ()):
    seen = [name for name in refuse_env if name in os.environ]  # credentials it must not be handed
    missing = [name for name in require_env if name not in os.environ]
    if seen or missing:
        raise RuntimeError(f"the environment was handed {seen} and not handed {missing}")
    if kind == "guess":
        return HigherLower(dataset=_guess_rows(40), max_turns=max_turns,
                           rubric=vf.Rubric(funcs=[guessed, few_guesses], weights=[1.0, 0.5]))
    if kind == "digits":
        return HigherLower(dataset=_guess_rows(40), max_turns=max_turns, rubric=vf.Rubric(funcs=[digits_said, guessed]),
                           memory_mb=memory_mb)
    if kind == "broken":
        funcs = [not_a_number] if mode == "nan" else [guessed]
        return Broken(mode, dataset=_guess_rows(4), max_turns=max_turns, rubric=vf.Rubric(funcs=funcs))
    if kind == "tools":
        rows = [{"question": f"What is {a}+{b}? Use the add tool.", "answer": str(a + b)}
                for a, b in ((17, 25), (33, 48), (61, 29))]
        return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], max_turns=3,
                          system_prompt="Use the tools you have.", rubric=vf.Rubric(funcs=[said_sum]))
    raise ValueError(f"no environment of kind {kind!r}")
