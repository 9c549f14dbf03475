"""Agent frameworks' tool calls, round trip: LangGraph, smolagents and pydantic-ai agents
(tests/integration/framework_agents), unchanged, run by the reward tier's agent launcher against a real
agent endpoint whose model is scripted to call the `lookup` tool first. Each framework runs the tool,
sends the call and its result back in its own form, and gets its answer; the episode is one sample
with the model's tokens masked in and the tool result masked out, and no `history_edited`. (A random
tiny model never writes a valid call: tests/integration/test_episodes.py runs the same agents on
vLLM, where they end without one.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rlmesh.learner.devtools.tiny_model import build_tokenizer
from rlmesh.reward_server.environments.agent import AgentEnvironment
from rlmesh.rollout_server.agent_endpoint import AgentEndpoint
from rlmesh.rollout_server.generator import Generation
from rlmesh.services.config import AgentEndpointSection, RolloutSection
from rlmesh.services.domain.chat import ChatCodec
from rlmesh.v1 import common_pb2

pytestmark = pytest.mark.integration
AGENTS = "tests.integration.framework_agents"
LOOKUP = '<tool_call>{"name": "lookup", "arguments": {"a": 579}}</tool_call>'


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptedGenerator:
    """Samples the scripted replies in turn, each closed by the end-of-turn token."""

    def __init__(self, replies: list[str]) -> None:
        self.tokenizer, self.version, self.model_path = build_tokenizer("bpe"), 0, "/models/tiny"
        self.codec = ChatCodec(self.tokenizer)
        self.replies = iter(replies)

    def sampling_params(self, group, index, *, max_tokens=None, turn=0):
        return SimpleNamespace(max_tokens=max_tokens)

    async def generate_ids(self, prompt_ids, params, request_id, on_text=None):
        text = next(self.replies)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.codec.eos_id]
        return Generation(ids, [-0.5] * len(ids), "stop", text, 0, 0)


@pytest.mark.asyncio
@pytest.mark.parametrize("agent, replies", [
    # the ReAct loop: the call, the answer after the tool's result; then the graph's last question
    ("langgraph_agent", [LOOKUP, "It is 579.", "579"]),
    # a step that calls lookup, a step that calls final_answer (smolagents' way to end)
    ("smolagents_agent", [f"Let me look. {LOOKUP}", _call("final_answer", answer="579")]),
    # the first run: the call, the answer; the second run on its messages: the final answer
    ("pydantic_ai_agent", [LOOKUP, "It is 579.", "579"]),
])
async def test_a_framework_runs_its_tool_and_the_episode_trains_on_what_was_sampled(agent, replies):
    generator = ScriptedGenerator(replies)
    endpoint = AgentEndpoint(generator, AgentEndpointSection(enabled=True), RolloutSection(max_model_len=1024))
    env = AgentEnvironment(agent, f"{AGENTS}.{agent}:solve", timeout_s=120)
    await endpoint.start()
    episode = endpoint.open(common_pb2.PromptGroup(group_id="g", n=1), 0)
    try:
        result = await env.run([{"role": "user", "content": "Add with the tool."}], {"answer": 579, "max_steps": 4},
                               endpoint.url, episode.key)
        sample = endpoint.close(episode)
    finally:
        env.close()
        await endpoint.stop()
    assert not result.error and result.reward == 1.0, result
    assert not sample.error and sample.finish_reason == "done" and sample.num_turns == len(replies), sample.error
    tok, ids = generator.tokenizer, list(sample.completion.token_ids)
    assert "lookup(a)" in tok.decode(ids[:sample.turns[0].start])  # the framework's tool, templated
    expected_mask = [False] * len(ids)
    for turn, reply in zip(sample.turns, replies):
        sampled = ids[turn.start: turn.start + turn.num_sampled_tokens]
        assert tok.decode(sampled) == reply + "<|im_end|>"
        expected_mask[turn.start: turn.start + turn.num_sampled_tokens] = [True] * turn.num_sampled_tokens
    assert list(sample.completion.loss_mask) == expected_mask
    first, second = sample.turns[:2]
    tool_result = tok.decode(ids[first.start + first.num_sampled_tokens: second.start])
    assert "result 579" in tool_result and tool_result.endswith("<|im_start|>assistant\n")
