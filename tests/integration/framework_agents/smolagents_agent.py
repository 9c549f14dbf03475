"""smolagents: a ToolCallingAgent's own step loop on OpenAIModel. A step whose reply holds no tool call
is an error smolagents feeds back and retries; at `max_steps` without a `final_answer` call it asks once
more under another system prompt and without tools (an edited history: give it `max_steps` at least the
endpoint's call budget, so that call is refused instead, and smolagents answers with the error)."""

from __future__ import annotations

from smolagents import OpenAIModel, ToolCallingAgent, tool


@tool
def lookup(a: int) -> str:
    """Look a number up.

    Args:
        a: The number to look up.
    """
    return f"result {a}"


def solve(prompt: list[dict], metadata: dict) -> dict:
    # retry=False: smolagents waits 60 s before retrying a 429, and the endpoint's 429 is the episode's
    # spent call budget (rollout.agent_endpoint.max_calls), which no wait renews.
    model = OpenAIModel(model_id="policy", retry=False, client_kwargs={"max_retries": 0})
    agent = ToolCallingAgent(tools=[lookup], model=model, max_steps=int(metadata["max_steps"]), verbosity_level=0)
    # smolagents' own system prompt is ~10 KB, past a tiny model's context: a short one, as its docs show.
    agent.prompt_templates["system_prompt"] = "Use the lookup tool, then call final_answer with the number."
    result = agent.run(prompt[-1]["content"], return_full_result=True)
    correct = float(str(int(metadata["answer"])) in str(result.output))
    return {"reward": correct, "components": {"correct": correct, "steps": float(len(result.steps))}}
