"""The demo through the Python API: `python examples/train_api.py [key=value ...]` trains
examples/arithmetic_grpo.yaml (dotted overrides as on the command line) with a reward function
defined here, and prints held-out accuracy before and after."""

import sys
from pathlib import Path

import rlmesh


def exact_answer(prompt, completion, metadata):
    """1 when the completion is exactly the answer; `correct` is what held-out accuracy reports."""
    correct = float(completion.strip() == str(metadata["answer"]))
    return {"reward": correct, "correct": correct}


if __name__ == "__main__":  # the reward server imports this file to find exact_answer
    config = Path(__file__).with_name("arithmetic_grpo.yaml")
    result = rlmesh.train(config, reward_fn=exact_answer, overrides=sys.argv[1:])
    before = result.held_out_accuracy_before  # None with learner.eval_at_start=false
    print(f"held-out accuracy: {'not evaluated' if before is None else f'{before:.2f}'} -> "
          f"{result.held_out_accuracy_after:.2f}")
