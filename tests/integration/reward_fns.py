"""User reward functions and a user multi-turn environment for the reward-server tests (loaded by
import path)."""

import time

from rlmesh.reward_server.environments.base import ResetOutput, StepOutput


def length_reward(prompt, completion, metadata):
    return {"reward": float(len(completion)), "chars": float(len(completion))}


def raising_reward(prompt, completion, metadata):
    raise KeyError("expected_field")


def sleepy_reward(prompt, completion, metadata):
    """Hangs (for `sleep_s`, default 3 s) when the completion is "hang"."""
    if completion == "hang":
        time.sleep(float(metadata.get("sleep_s", 3.0)))
    return 1.0


def nan_reward(prompt, completion, metadata):
    return float(completion)  # "nan", "inf", "1"


class SlowEnv:
    """Multi-turn: a step whose action is "hang" sleeps 3 s; any other action ends the episode."""

    description = "test environment whose steps can hang"

    def tools(self):
        return []

    def reset(self, metadata, prompt):
        return ResetOutput(state={}, observation=[{"role": "user", "content": "go"}])

    def step(self, state, action):
        if action["content"] == "hang":
            time.sleep(3.0)
        return StepOutput(reward=1.0, done=True, components={"correct": 1.0})

    def close(self, state):
        pass
