"""Agents written with agent frameworks as their users write them, one framework a module, for the
`agent` environments of the episode tests: each module imports its framework at the top (the agent
launcher pays that once) and makes its model client when the agent runs, from OPENAI_BASE_URL and
OPENAI_API_KEY (the launcher imports the module without them). Each agent looks a number up with a
`lookup` tool and scores the task's `answer` in what the model said last."""

FINAL_QUESTION = "What is the final answer? Reply with the number only."
