"""The control plane fails closed: a stranger without the token, without a certificate, or with the
wrong tier's certificate is refused before the server parses its request or runs anything; a
server reachable beyond loopback does not start without credentials. Real gRPC servers on
loopback; the rollout server's and learner's own authorization policies."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from rlmesh.learner.rl.server import POLICY as LEARNER_POLICY
from rlmesh.reward_server.server import POLICY as REWARD_POLICY
from rlmesh.reward_server.service import RewardService
from rlmesh.rollout_server.server import POLICY as ROLLOUT_POLICY
from rlmesh.services.auth import TLSFiles
from rlmesh.services.config import load_config
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server
from rlmesh.services.tls_certs import make_certificates
from rlmesh.v1 import learner_pb2, learner_pb2_grpc, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.conftest import rlmesh_cmd

pytestmark = pytest.mark.security
TOKEN = "the-shared-token"
ROLLOUT = "rlmesh.v1.RolloutService"


class Rollout(rollout_pb2_grpc.RolloutServiceServicer):
    """Stands in for the vLLM servicer: records which methods actually ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def PauseGeneration(self, request, context):
        self.calls.append("PauseGeneration")
        return rollout_pb2.PauseGenerationResponse()

    async def InitWeightTransfer(self, request, context):
        self.calls.append("InitWeightTransfer")
        return rollout_pb2.InitWeightTransferResponse()

    async def GetStatus(self, request, context):
        self.calls.append("GetStatus")
        return rollout_pb2.RolloutStatusResponse(generator_id="r0")


class Learner(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def RegisterGenerator(self, request, context):
        self.calls.append("RegisterGenerator")
        return learner_pb2.RegisterGeneratorResponse()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    good = tmp_path_factory.mktemp("certs")
    make_certificates(good)
    foreign = tmp_path_factory.mktemp("foreign")  # another CA's certificates, tiers and all
    make_certificates(foreign)
    return good, foreign


def _tls(directory, tier: str, *, with_cert: bool = True) -> TLSFiles:
    return TLSFiles(str(directory / f"{tier}.crt") if with_cert else None,
                    str(directory / f"{tier}.key") if with_cert else None, str(directory / "ca.crt"))


async def _rollout_server(**kw):
    servicer = Rollout()
    server = await start_server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, servicer, ROLLOUT)],
                                port=0, policy=ROLLOUT_POLICY, **kw)
    return server, servicer


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "rlmesh-learner"])
async def test_a_server_beyond_loopback_without_credentials_does_not_start(host):
    with pytest.raises(ValueError) as err:
        await start_server([], host=host, port=0)
    message = str(err.value)
    for hint in ("network.token_file", "RLMESH_TOKEN", "network.insecure=true", "network.tls"):
        assert hint in message


async def test_beyond_loopback_it_starts_with_a_token_or_the_explicit_opt_out():
    for kw in ({"token": TOKEN}, {"insecure": True}):
        server = await start_server([], host="0.0.0.0", port=0, **kw)
        await server.stop(0)


def test_the_tier_commands_refuse_before_loading_anything(tmp_path):
    out = subprocess.run(rlmesh_cmd("reward", "network.host=0.0.0.0"), capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path.parent)
    assert out.returncode == 2
    assert "network.token_file" in out.stderr and "network.insecure=true" in out.stderr


async def test_no_or_a_wrong_token_is_refused_before_the_request_is_parsed():
    server, servicer = await _rollout_server(token=TOKEN)
    address = f"127.0.0.1:{server.port}"
    garbage = b"\xff\xff\xff\xff not a protobuf message"
    try:
        for token in (None, "wrong"):
            async with make_channel(address, token=token) as channel:
                raw = channel.unary_unary(f"/{ROLLOUT}/PauseGeneration")  # bytes in, bytes out
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await raw(garbage)
                # Not a parse error: the body was never read as a message.
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "bearer token" in err.value.details()
        assert servicer.calls == []
        async with make_channel(address, token=TOKEN) as channel:
            raw = channel.unary_unary(f"/{ROLLOUT}/PauseGeneration")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw(garbage)
            assert err.value.code() != grpc.StatusCode.UNAUTHENTICATED  # with the token, parsing is what fails
            await rollout_pb2_grpc.RolloutServiceStub(channel).PauseGeneration(rollout_pb2.PauseGenerationRequest())
        assert servicer.calls == ["PauseGeneration"]
    finally:
        await server.stop(0)


async def test_mutual_tls_refuses_a_client_without_a_certificate_or_from_another_ca(certs):
    good, foreign = certs
    server, servicer = await _rollout_server(tls=_tls(good, "rollout"))
    address = f"127.0.0.1:{server.port}"
    try:
        for tls in (_tls(good, "learner", with_cert=False), TLSFiles(str(foreign / "learner.crt"),
                                                                     str(foreign / "learner.key"), str(good / "ca.crt"))):
            async with make_channel(address, tls=tls, peer="rollout", default_timeout_s=5) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await rollout_pb2_grpc.RolloutServiceStub(channel).GetStatus(rollout_pb2.RolloutStatusRequest())
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails
        async with make_channel(address, peer="rollout", default_timeout_s=5) as channel:  # plaintext
            with pytest.raises(grpc.aio.AioRpcError):
                await rollout_pb2_grpc.RolloutServiceStub(channel).GetStatus(rollout_pb2.RolloutStatusRequest())
        assert servicer.calls == []
        async with make_channel(address, tls=_tls(good, "learner"), peer="rollout") as channel:
            reply = await rollout_pb2_grpc.RolloutServiceStub(channel).GetStatus(rollout_pb2.RolloutStatusRequest())
        assert reply.generator_id == "r0"
    finally:
        await server.stop(0)


async def test_only_the_learners_certificate_moves_weights_or_pauses_a_rollout_server(certs):
    good, _ = certs
    server, servicer = await _rollout_server(tls=_tls(good, "rollout"))
    address = f"127.0.0.1:{server.port}"
    try:
        for tier in ("rollout", "reward"):
            async with make_channel(address, tls=_tls(good, tier), peer="rollout") as channel:
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                for call, request in ((stub.PauseGeneration, rollout_pb2.PauseGenerationRequest()),
                                      (stub.InitWeightTransfer, rollout_pb2.InitWeightTransferRequest())):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(request)
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "only by learner" in err.value.details() and repr(tier) in err.value.details()
                await stub.GetStatus(rollout_pb2.RolloutStatusRequest())  # open to every tier
        assert servicer.calls == ["GetStatus", "GetStatus"]
        async with make_channel(address, tls=_tls(good, "learner"), peer="rollout") as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            await stub.PauseGeneration(rollout_pb2.PauseGenerationRequest())
            await stub.InitWeightTransfer(rollout_pb2.InitWeightTransferRequest())
        assert servicer.calls[-2:] == ["PauseGeneration", "InitWeightTransfer"]
    finally:
        await server.stop(0)


async def test_only_rollout_servers_join_the_learner(certs):
    good, _ = certs
    servicer = Learner()
    server = await start_server([(learner_pb2_grpc.add_LearnerServiceServicer_to_server, servicer,
                                  "rlmesh.v1.LearnerService")], port=0, tls=_tls(good, "learner"),
                                policy=LEARNER_POLICY)
    address = f"127.0.0.1:{server.port}"
    try:
        async with make_channel(address, tls=_tls(good, "reward"), peer="learner") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await learner_pb2_grpc.LearnerServiceStub(channel).RegisterGenerator(
                    learner_pb2.RegisterGeneratorRequest(generator_id="evil", address="10.9.9.9:1"))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        async with make_channel(address, tls=_tls(good, "rollout"), peer="learner") as channel:
            await learner_pb2_grpc.LearnerServiceStub(channel).RegisterGenerator(
                learner_pb2.RegisterGeneratorRequest(generator_id="r0", address="127.0.0.1:1"))
        assert servicer.calls == ["RegisterGenerator"]
    finally:
        await server.stop(0)


async def test_only_rollout_servers_start_agent_episodes_on_the_reward_server(certs):
    """RunAgent runs the configured agent against the endpoint the caller names: under mutual TLS only
    a rollout server's certificate may ask for it; the reward server's other methods stay open."""
    good, _ = certs
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, RewardService(builtin=[]),
                                  "rlmesh.v1.RewardService")], port=0, tls=_tls(good, "reward"), policy=REWARD_POLICY)
    address = f"127.0.0.1:{server.port}"
    request = reward_pb2.RunAgentRequest(env_name="solver", base_url="http://10.9.9.9/v1", api_key="k")
    try:
        for tier in ("learner", "reward"):
            async with make_channel(address, tls=_tls(good, tier), peer="reward") as channel:
                stub = reward_pb2_grpc.RewardServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.RunAgent(request)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                await stub.ListEnvironments(reward_pb2.ListEnvironmentsRequest())  # open to every tier
        async with make_channel(address, tls=_tls(good, "rollout"), peer="reward") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:  # let through, then refused for what it asks
                await reward_pb2_grpc.RewardServiceStub(channel).RunAgent(request)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no agent environment 'solver'" in err.value.details()
    finally:
        await server.stop(0)


async def test_a_server_certificate_for_another_tier_is_refused_by_the_client(certs):
    """The learner dialling a "rollout server" that presents the reward tier's certificate."""
    good, _ = certs
    server, servicer = await _rollout_server(tls=_tls(good, "reward"))
    try:
        async with make_channel(f"127.0.0.1:{server.port}", tls=_tls(good, "learner"), peer="rollout",
                                default_timeout_s=5) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rollout_pb2_grpc.RolloutServiceStub(channel).PauseGeneration(
                    rollout_pb2.PauseGenerationRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert servicer.calls == []
    finally:
        await server.stop(0)


def test_tls_files_come_from_config_per_tier(certs, tmp_path):
    good, _ = certs
    config = load_config(None, [f"network.tls.cert_file={good}/{{tier}}.crt", f"network.tls.key_file={good}/{{tier}}.key",
                                f"network.tls.ca_file={good}/ca.crt"])
    tls = TLSFiles.from_config(config.network, "rollout")
    assert tls.cert == f"{good}/rollout.crt" and tls.mutual
    missing = load_config(None, [f"network.tls.cert_file={tmp_path}/{{tier}}.crt"])
    with pytest.raises(ValueError, match="network.tls.cert_file=.*tls-init"):
        TLSFiles.from_config(missing.network, "learner")
