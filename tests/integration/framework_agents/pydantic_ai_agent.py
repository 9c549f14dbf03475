"""pydantic-ai: an Agent with a tool on OpenAI chat completions (OpenAIChatModel), run once, then run
again on the first run's messages for the final answer."""

from __future__ import annotations

from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel

from tests.integration.framework_agents import FINAL_QUESTION


def lookup(a: int) -> str:
    """Look a number up."""
    return f"result {a}"


def solve(prompt: list[dict], metadata: dict) -> dict:
    agent = Agent(OpenAIChatModel("policy"), instructions="Use the lookup tool, then answer.", tools=[lookup],
                  retries=0)
    first = agent.run_sync(prompt[-1]["content"])
    final = agent.run_sync(FINAL_QUESTION, message_history=first.all_messages())
    correct = float(str(int(metadata["answer"])) in final.output)
    return {"reward": correct, "components": {"correct": correct, "runs": 2.0}}
