"""User reward functions for the reward-server tests (loaded by import path)."""


def length_reward(prompt, completion, metadata):
    return {"reward": float(len(completion)), "chars": float(len(completion))}


def raising_reward(prompt, completion, metadata):
    raise KeyError("expected_field")
