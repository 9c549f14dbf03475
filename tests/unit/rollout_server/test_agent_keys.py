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
from rlmesh.services.domain.chat import ChatCodec
from rlmesh.v1 import common_pb2


class SlowGenerator:
    def __init__(self) -> None:
        self.tokenizer, self.version, self.model_path = build_tokenizer("bytes"), 0, "/models/tiny"
        self.codec = ChatCodec(self.tokenizer)
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


@pytest.mark.asyncio
async def test_with_tls_the_endpoint_speaks_https_that_an_agent_given_the_ca_verifies(tmp_path, monkeypatch):
    """Under network.tls the endpoint serves HTTPS with the rollout tier's certificate: the openai client
    with the mesh's CA as SSL_CERT_FILE (what the reward tier gives its agents) gets its answer; plain HTTP
    and a client that trusts only the public CAs get none."""
    import openai

    from rlmesh.services.auth import TLSFiles
    from rlmesh.services.tls_certs import make_certificates

    certs = make_certificates(tmp_path)
    generator = SlowGenerator()
    generator.release.set()
    tls = TLSFiles(str(certs["rollout"]), str(tmp_path / "rollout.key"), str(certs["ca"]))
    endpoint = AgentEndpoint(generator, AgentEndpointSection(enabled=True), RolloutSection(max_model_len=512), tls)
    await endpoint.start()
    episode = endpoint.open(common_pb2.PromptGroup(group_id="g", n=1), 0)
    messages = [{"role": "user", "content": "hi"}]
    try:
        assert endpoint.url.startswith("https://127.0.0.1:")
        monkeypatch.setenv("SSL_CERT_FILE", str(certs["ca"]))
        client = openai.AsyncOpenAI(base_url=endpoint.url, api_key=episode.key, max_retries=0)
        reply = await client.chat.completions.create(model="tiny", messages=messages)
        assert reply.choices[0].message.content == "ok"
        monkeypatch.delenv("SSL_CERT_FILE")
        untrusting = openai.AsyncOpenAI(base_url=endpoint.url, api_key=episode.key, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            await untrusting.chat.completions.create(model="tiny", messages=messages)
        plain = openai.AsyncOpenAI(base_url=endpoint.url.replace("https://", "http://"), api_key=episode.key,
                                   max_retries=0)
        with pytest.raises((openai.APIConnectionError, openai.APIStatusError)):
            await plain.chat.completions.create(model="tiny", messages=messages)
        assert endpoint.close(episode).num_turns == 1  # only the verified call reached the model
    finally:
        await endpoint.stop()
