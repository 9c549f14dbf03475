"""A word-problem agent written with the OpenAI Agents SDK, as its users write one: nothing in it is
rlmesh's. It lets the model work the problem out, then asks it, in the same conversation, for the
final answer alone, and scores that answer against the task's. rlmesh trains the model behind it
(examples/smollm2_agent_grpo.yaml): the agent finds the model at OPENAI_BASE_URL with OPENAI_API_KEY,
which rlmesh sets for each episode."""

import re

from agents import Agent, ModelSettings, Runner, set_default_openai_api, set_tracing_disabled
from math_verify import parse, verify

set_default_openai_api("chat_completions")  # the endpoint speaks chat completions
set_tracing_disabled(True)  # send no traces anywhere

# Warm math-verify at import: rlmesh imports this module once and forks every episode from there, so
# the regexes and LaTeX-parser tables its first call builds are built once, not in every episode.
verify(parse("$12$"), parse("$12$"))

solver = Agent(name="solver")
answerer = Agent(name="answerer", model_settings=ModelSettings(max_tokens=24))
ASK = "What is the final answer? Reply with the number only."


def last_number(text: str) -> str | None:
    found = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text or "")
    return found[-1].replace(",", "") if found else None


def solve(prompt: list[dict], metadata: dict) -> dict:
    worked = Runner.run_sync(solver, prompt[-1]["content"], max_turns=1)
    asked = worked.to_input_list() + [{"role": "user", "content": ASK}]
    final = Runner.run_sync(answerer, asked, max_turns=1)
    answer = last_number(final.final_output)
    correct = float(answer is not None and verify(parse(f"${metadata['answer']}$"), parse(f"${answer}$")))
    return {"reward": correct, "components": {"correct": correct, "answered": float(answer is not None)}}
