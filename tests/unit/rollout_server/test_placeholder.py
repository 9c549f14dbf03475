"""A rollout server started on placeholder weights (`rlmesh up` starts it on the model from before
the SFT warm start while SFT runs): it claims no learner version, the learner sees it as out of date
(so its version 0 is broadcast before anything is served), and Generate refuses it, over real gRPC."""

from __future__ import annotations

import grpc
import pytest

from rlmesh.learner.rl.membership import Membership
from rlmesh.rollout_server.generator import VLLMGenerator
from rlmesh.rollout_server.service import RolloutService
from rlmesh.services.config import RolloutSection, WeightSyncSection
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server
from rlmesh.services.weights import build_receiver
from rlmesh.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


async def test_placeholder_weights_are_no_learner_version():
    # async: VLLMGenerator binds asyncio primitives to the running loop (a sync test has none once
    # other tests have run on the session loop)
    normal = VLLMGenerator("model", RolloutSection(), 0, "gloo")
    held = VLLMGenerator("model", RolloutSection(), 0, "gloo", placeholder=True)
    membership = Membership(token=None, rpc_timeout_s=5)
    membership.register("normal", "127.0.0.1:1", num_workers=1, version=normal.version)
    membership.register("held", "127.0.0.1:2", num_workers=1, version=held.version)
    assert normal.version == 0 and not normal.placeholder
    assert held.version == -1 and held.placeholder
    assert [g.generator_id for g in membership.out_of_date(0)] == ["held"]


async def test_generate_is_refused_until_the_learner_sends_weights():
    generator = VLLMGenerator("model", RolloutSection(), 0, "gloo", placeholder=True)
    service = RolloutService(generator, "gen", build_receiver(WeightSyncSection(backend="gloo")))
    server = await start_server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, service,
                                  "rlmesh.v1.RolloutService")], port=0)
    channel = make_channel(f"127.0.0.1:{server.port}", default_timeout_s=10)
    try:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        request = rollout_pb2.GenerateRequest(prompt=common_pb2.PromptGroup(
            group_id="g", n=2, prompt_tokens=common_pb2.TokenSequence(token_ids=[1, 2, 3])))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(request):
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "placeholder weights" in err.value.details()
    finally:
        await channel.close()
        await server.stop(0)
