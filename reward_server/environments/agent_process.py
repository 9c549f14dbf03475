"""The process one agent episode runs in: `python -m rlmesh.reward_server.environments.agent_process
module:function TASK_FILE SERVER_PID`. Reads the task ({"prompt", "metadata"}) as JSON from the file,
calls the agent, and writes its answer ({"reward", "components"}) as the last line of stdout; whatever the agent prints
goes to stderr, so it cannot be taken for the answer. If the reward server goes, however it went, the
agent goes too, with whatever it started (its process group)."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys

from rlmesh.reward_server.environments.base import load_callable
from rlmesh.reward_server.function_workers import exit_with_parent


def main() -> None:
    exit_with_parent(int(sys.argv[3]), with_group=True)
    answer_to = sys.stdout
    sys.stdout = sys.stderr  # an agent's prints go to the log, never into the answer
    with open(sys.argv[2]) as f:
        task = json.load(f)
    agent = load_callable(sys.argv[1])
    result = agent(task["prompt"], task["metadata"])
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    answer = result if isinstance(result, dict) else {"reward": result}
    answer_to.write(json.dumps(answer, default=repr) + "\n")
    answer_to.flush()


async def _awaited(awaitable):
    return await awaitable


if __name__ == "__main__":
    main()
