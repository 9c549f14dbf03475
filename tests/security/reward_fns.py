"""Reward functions that misbehave, for tests/security/test_reward_workers.py (loaded by import path
into the reward server's worker processes; stdlib only, so a worker stays small)."""

import os
import time


def hog(prompt, completion, metadata):
    """Allocates without bound."""
    blocks = []
    while True:
        blocks.append(bytearray(16 * 1024 * 1024))


def spin(prompt, completion, metadata):
    """Never returns, burning CPU."""
    while True:
        pass


def sleeper(prompt, completion, metadata):
    """Never returns, using no CPU."""
    while True:
        time.sleep(1.0)


def secrets_seen(prompt, completion, metadata):
    """1.0 for every variable that looks like a credential in the worker's environment."""
    names = [k for k in os.environ if "TOKEN" in k or "PASSWORD" in k or "SECRET" in k]
    return {"reward": float(len(names)), "pid": float(os.getpid())}


def ok(prompt, completion, metadata):
    return {"reward": 1.0, "pid": float(os.getpid())}


def scribbler(prompt, completion, metadata):
    """Writes junk into every file descriptor it can find (the answer pipe among them)."""
    for fd in range(3, 16):
        try:
            os.write(fd, b"not an answer\n")
        except OSError:
            pass
    return 1.0
