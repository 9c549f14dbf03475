"""Multi-turn environments for the episode tests, loaded by the reward server as `module:Class`."""

from __future__ import annotations

import time
from pathlib import Path

from rlmesh.reward_server.environments.base import ResetOutput, StepOutput

LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a number up.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}


class LookupTools:
    """Offers a `lookup` tool and answers every turn with a tool message (numbers and words, so
    that a BPE tokenizer merges inside it); the episode ends after `metadata.turns` turns (3) with
    reward 1 when the last message holds a digit. A per-session first observation varies with the
    session so that episodes of one group start from different contexts."""

    description = "test: tool answers every turn"

    def __init__(self) -> None:
        self.num_resets = 0

    def tools(self) -> list[dict]:
        return [LOOKUP_TOOL]

    def reset(self, metadata: dict, prompt: list[dict]) -> ResetOutput:
        self.num_resets += 1
        state = {"turns": 0, "max": int(metadata.get("turns", 3))}
        return ResetOutput(state, [{"role": "user", "content": f"Session {self.num_resets % 4}: 12 + 345?"}])

    def step(self, state: dict, action: dict) -> StepOutput:
        state["turns"] += 1
        if state["turns"] >= state["max"]:
            hit = float(any(ch.isdigit() for ch in action["content"]))
            return StepOutput(reward=hit, done=True, components={"correct": hit})
        return StepOutput([{"role": "tool", "name": "lookup", "content": f"result 579 then {state['turns']}0 sum"}])

    def close(self, state: dict) -> None:
        pass


class SleepyTool(LookupTools):
    """Its tool takes `metadata.sleep_s` (5 s) on the first step: past the rollout's step timeout.
    When `metadata.flag` names a file, it is written as the slow step starts."""

    def reset(self, metadata: dict, prompt: list[dict]) -> ResetOutput:
        out = super().reset(metadata, prompt)
        out.state.update(sleep_s=float(metadata.get("sleep_s", 5.0)), flag=metadata.get("flag", ""))
        return out

    def step(self, state: dict, action: dict) -> StepOutput:
        if state["turns"] == 0:
            if state["flag"]:
                Path(state["flag"]).write_text("stepping")
            time.sleep(state["sleep_s"])
        return super().step(state, action)


class RaisingTool(LookupTools):
    """Its tool raises on the second step."""

    def step(self, state: dict, action: dict) -> StepOutput:
        if state["turns"] == 1:
            raise RuntimeError("the lookup tool exploded")
        return super().step(state, action)
