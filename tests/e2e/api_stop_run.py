"""Driver for tests/e2e/test_api.py: the Python API example's reward function (examples/train_api.py's
`exact_answer`, shipped to the reward server by import path as the example ships it) trained through
`rlmesh.train` with a callback that stops the run at a step, then `rlmesh.export`.
Usage: python api_stop_run.py STOP_AT [key=value ...]; prints the result as JSON on its last line."""

import json
import sys
from pathlib import Path

import rlmesh

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from train_api import exact_answer  # noqa: E402  (examples/ is no package: the script's own directory)


class StopAt(rlmesh.Callback):
    def __init__(self, stop_at: int) -> None:
        self.stop_at = stop_at
        self.steps: list[int] = []
        self.evals: list[list[float]] = []

    def on_step_end(self, step, metrics):
        self.steps.append(step)
        if step >= self.stop_at:
            raise rlmesh.StopTraining(f"seen step {step}")

    def on_eval(self, version, record):
        self.evals.append([version, record["accuracy"]])


if __name__ == "__main__":
    callback = StopAt(int(sys.argv[1]))
    result = rlmesh.train(EXAMPLES / "arithmetic_grpo.yaml", reward_fn=exact_answer, callbacks=[callback],
                          overrides=sys.argv[2:])
    exported = rlmesh.export(result.run_dir, output=result.run_dir / "exported")
    print(json.dumps({"exported": str(exported), "run_dir": str(result.run_dir),
                      "checkpoint": str(result.checkpoint), "num_steps": result.num_steps,
                      "stopped_early": result.stopped_early, "before": result.held_out_accuracy_before,
                      "after": result.held_out_accuracy_after, "steps": callback.steps, "evals": callback.evals}))
