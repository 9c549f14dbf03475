"""An episode's key works only while its episode is open, and one episode answers one call at a time.
The endpoint runs for real (aiohttp on loopback); the generator is a stand-in that samples fixed ids
(vLLM is exercised by tests/integration/test_episodes.py's agent test)."""

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from rlmesh.learner.devtools.tiny_model import build_tokenizer
from rlmesh.rollout_server.agent_endpoint import AgentEndpoint
from rlmesh.rollout_server.generator import Generation
from rlmesh.services.config import AgentEndpointSection, RolloutSection
from rlmesh.v1 import common_pb2


class SlowGenerator:
    def __init__(self) -> None:
        self.tokenizer, self.version, self.model_path = build_tokenizer("bytes"), 0, "/models/tiny"
        self.release = asyncio.Event()

    def sampling_params(self, group, index, *, max_tokens=None, turn=0):
        return SimpleNamespace(max_tokens=max_tokens)

    async def generate_ids(self, prompt_ids, params, request_id, on_text=None):
        await self.release.wait()
        ids = list(self.tokenizer.encode("ok", add_special_tokens=False))
        return Generation(ids, [-0.5] * len(ids), "stop", "ok", 0, 0)


@pytest.mark.asyncio
async def test_a_key_dies_with_its_episode_and_calls_do_not_overlap():
    generator = SlowGenerator()
    endpoint = AgentEndpoint(generator, AgentEndpointSection(enabled=True), RolloutSection(max_model_len=512))
    await endpoint.start()
    episode = endpoint.open(common_pb2.PromptGroup(group_id="g", n=1), 0)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {episode.key}"}) as http:
            first = asyncio.create_task(http.post(f"{endpoint.url}/chat/completions", json=body))
            await asyncio.sleep(0.2)  # the first call is generating
            async with http.post(f"{endpoint.url}/chat/completions", json=body) as r:
                assert r.status == 409 and (await r.json())["error"]["code"] == "concurrent_call"
            generator.release.set()
            async with await first as r:
                reply = await r.json()
                assert r.status == 200 and reply["choices"][0]["message"]["content"] == "ok"
                assert reply["model"] == "tiny" and reply["usage"]["completion_tokens"] == 2
            async with http.get(f"{endpoint.url}/models") as r:
                assert r.status == 200
            sample = endpoint.close(episode)
            assert sample.num_turns == 1 and not sample.error and len(endpoint) == 0
            async with http.post(f"{endpoint.url}/chat/completions", json=body) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    finally:
        await endpoint.stop()
