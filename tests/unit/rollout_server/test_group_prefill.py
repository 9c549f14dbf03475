"""A group's samples share its prompt's prefill when prefix caching is on: the first sample starts
alone and the others once its first token is out (vLLM caches a block only once it is computed, so
samples started together would each compute the whole prompt). A fake engine stands in for vLLM and
records when each request starts; the KV reuse itself is vLLM's (bench/rollout_throughput.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rlmesh.rollout_server.generator import VLLMGenerator
from rlmesh.services.config import RolloutSection
from rlmesh.v1 import common_pb2


class FakeEngine:
    """Streams a request's tokens one event-loop turn apart; logs (request index, event) in order."""

    def __init__(self, block_size: int, fail_lead: bool = False) -> None:
        self.events: list[tuple[int, str]] = []
        self.priorities: dict[str, int] = {}  # request id -> the vLLM priority it was given
        self.fail_lead = fail_lead
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size))

    async def generate(self, prompt, params, request_id, lora_request=None, priority=0):
        self.priorities[request_id] = priority
        index = int(request_id.split("-")[1])
        self.events.append((index, "start"))
        await asyncio.sleep(0)
        if self.fail_lead and index == 0:
            raise RuntimeError("engine died during the prefill")
        ids = []
        for tok in (7, 8, 9):
            await asyncio.sleep(0)
            ids.append(tok)
            self.events.append((index, f"token {len(ids)}"))
            lps = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(ids), logprobs=lps, text="x" * len(ids),
                                                           finish_reason="length" if len(ids) == 3 else None)])


def generator(**rollout) -> tuple[VLLMGenerator, FakeEngine]:
    """A generator on a fake engine whose block is what vLLM-CPU's would be: rollout.block_size, else 128."""
    fail_lead = rollout.pop("fail_lead", False)
    gen = VLLMGenerator("model", RolloutSection(**rollout), 0, "gloo")
    gen.engine = FakeEngine(gen.cfg.block_size or 128, fail_lead)
    return gen, gen.engine


def group(n: int, prompt_len: int) -> common_pb2.PromptGroup:
    return common_pb2.PromptGroup(group_id="g", n=n, prompt_tokens=common_pb2.TokenSequence(
        token_ids=list(range(1, prompt_len + 1))))


async def test_the_rest_of_a_group_starts_after_the_first_samples_prefill():
    gen, engine = generator(enable_prefix_caching=True, block_size=32)
    prompt, samples = await gen.generate_group(group(4, 62))
    starts = [i for i, e in engine.events if e == "start"]
    assert starts == [0, 1, 2, 3]
    first_token = engine.events.index((0, "token 1"))
    assert all(engine.events.index((i, "start")) > first_token for i in (1, 2, 3)), engine.events
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert all(list(s.completion.token_ids) == [7, 8, 9] and list(s.logprobs) == [-0.5] * 3 for s in samples)
    assert prompt == list(range(1, 63))


@pytest.mark.parametrize("rollout,prompt_len", [
    ({"enable_prefix_caching": False, "block_size": 32}, 62),  # nothing is cached: no reason to wait
    ({"enable_prefix_caching": True, "block_size": 64}, 62),   # no full block to share
    ({"enable_prefix_caching": True}, 62),                      # the engine's block (128 here) is longer than the prompt
])
async def test_samples_start_together_where_nothing_can_be_shared(rollout, prompt_len):
    gen, engine = generator(**rollout)
    await gen.generate_group(group(4, prompt_len))
    assert [e for _, e in engine.events[:4]] == ["start"] * 4, engine.events


async def test_a_first_sample_that_fails_before_its_first_token_fails_the_group_alone():
    gen, engine = generator(enable_prefix_caching=True, block_size=32, fail_lead=True)
    with pytest.raises(RuntimeError, match="engine died"):
        await gen.generate_group(group(4, 62))
    assert engine.events == [(0, "start")]


@pytest.mark.parametrize("caching", [True, False])
async def test_every_sample_of_a_group_waits_in_the_place_of_its_claim(caching):
    """vLLM takes waiting requests lowest priority first: a group's samples (those started after its
    prefill too) all carry the group's claim order, and a group claimed later waits behind them."""
    gen, engine = generator(enable_prefix_caching=caching, block_size=32)
    first, second = (common_pb2.PromptGroup(group_id=name, n=4, prompt_tokens=common_pb2.TokenSequence(
        token_ids=list(range(1, 63)))) for name in ("a", "b"))
    await asyncio.gather(gen.generate_group(first), gen.generate_group(second))
    by_group = {name: {p for rid, p in engine.priorities.items() if rid.startswith(f"{name}-")} for name in "ab"}
    assert len(engine.priorities) == 8
    assert len(by_group["a"]) == len(by_group["b"]) == 1, engine.priorities
    assert by_group["a"].pop() < by_group["b"].pop()


async def test_a_later_group_enters_once_the_earlier_one_is_all_in():
    """The first sample of the group claimed second starts only after every sample of the first
    group has started (its others wait for its prefill): vLLM would hand the free places to whatever
    waits, and a later group sent early would take them."""
    gen, engine = generator(enable_prefix_caching=True, block_size=32)
    first, second = (common_pb2.PromptGroup(group_id=name, n=4, prompt_tokens=common_pb2.TokenSequence(
        token_ids=list(range(1, 63)))) for name in ("a", "b"))
    starts: list[str] = []
    real = engine.generate

    def generate(prompt, params, request_id, **kw):
        starts.append(request_id.split("-")[0])
        return real(prompt, params, request_id, **kw)

    engine.generate = generate
    await asyncio.gather(gen.generate_group(first), gen.generate_group(second))
    assert starts == ["a"] * 4 + ["b"] * 4, starts
