"""Server factory and client channel against a real gRPC server on a free port."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.ports import free_port

pytestmark = pytest.mark.integration
TOKEN = "s3cret"


def _start_server(port: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("grpc_test_server.py")), TOKEN, str(port)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    return proc, f"127.0.0.1:{int(proc.stdout.readline())}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture
def server():
    proc, address = _start_server()
    yield proc, address
    _stop(proc)


def _request(sleep: float = 0.0) -> reward_pb2.ScoreRequest:
    meta = Struct()
    meta.update({"sleep": sleep})
    return reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id="a", env_name="x", env_metadata=meta)])


async def test_health_is_serving_without_a_token(server):
    _, address = server
    async with make_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="rlmesh.v1.RewardService"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_call_without_or_with_wrong_token_is_unauthenticated(server):
    _, address = server
    for token in (None, "wrong"):
        async with make_channel(address, token=token) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await reward_pb2_grpc.RewardServiceStub(channel).Score(_request())
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in err.value.details()
    async with make_channel(address, token=TOKEN) as channel:
        reply = await reward_pb2_grpc.RewardServiceStub(channel).Score(_request())
        assert reply.results[0].reward == 1.0


async def test_call_past_its_deadline_gets_deadline_exceeded(server):
    _, address = server
    async with make_channel(address, token=TOKEN, default_timeout_s=0.3) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await reward_pb2_grpc.RewardServiceStub(channel).Score(_request(sleep=2.0))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_sigterm_drains_in_flight_calls(server):
    proc, address = server
    async with make_channel(address, token=TOKEN) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        in_flight = asyncio.ensure_future(stub.Score(_request(sleep=1.5), timeout=10))
        await asyncio.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        reply = await in_flight
        assert reply.results[0].reward == 1.0, "the call in flight at SIGTERM completes"
        await asyncio.sleep(0.3)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # new calls are refused while draining/after
            await stub.Score(_request(), timeout=1.0)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    t0 = time.monotonic()
    assert proc.wait(timeout=15) == 0
    assert time.monotonic() - t0 < 15
    assert proc.stdout.read().strip() == "drained"


async def test_wait_for_serving_returns_once_serving_and_names_what_it_waited_for(server):
    from rlmesh.services.grpc_client import ExitedWhileStarting, wait_for_serving

    _, address = server
    t0 = time.monotonic()
    await wait_for_serving(address, what="test server", timeout_s=10, service="rlmesh.v1.RewardService")
    assert time.monotonic() - t0 < 5
    # A service name the server does not know answers NOT_FOUND: still waited on, until the deadline.
    with pytest.raises(TimeoutError, match=rf"test server at {address} not SERVING after 1s \(last: NOT_FOUND"):
        await wait_for_serving(address, what="test server", timeout_s=1.0, service="no.such.Service")
    with pytest.raises(TimeoutError, match=r"nobody at 127\.0\.0\.1:1 not SERVING after 1s \(last: (UNAVAILABLE|DEADLINE_EXCEEDED)"):
        await wait_for_serving("127.0.0.1:1", what="nobody", timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(ExitedWhileStarting, match="nobody exited while starting"):
        await wait_for_serving("127.0.0.1:1", what="nobody", timeout_s=30, alive=lambda: False)
    assert time.monotonic() - t0 < 5, "a dead process is reported at once, not after the timeout"


async def test_a_channel_reaches_a_peer_within_seconds_of_it_listening_after_a_long_absence():
    """A rollout server dials its learner while the learner is still in SFT, for minutes. gRPC's own
    reconnect backoff would grow to 120 s (after 17 s of refusals its next dial comes 7-13 s later);
    the mesh's channels cap it at 2 s, so the first step is not held back once the learner listens."""
    port = free_port()
    async with make_channel(f"127.0.0.1:{port}", token=TOKEN) as channel:
        stub_call = reward_pb2_grpc.RewardServiceStub(channel).Score
        t0 = time.monotonic()
        while time.monotonic() - t0 < 17:
            with pytest.raises(grpc.aio.AioRpcError):
                await stub_call(_request(), timeout=1)
            await asyncio.sleep(0.5)
        proc, _ = _start_server(port)
        try:
            listening = time.monotonic()
            while True:
                try:
                    await stub_call(_request(), timeout=1)
                    break
                except grpc.aio.AioRpcError:
                    assert time.monotonic() - listening < 5, "the channel did not dial the peer again within 5 s"
                    await asyncio.sleep(0.1)
        finally:
            _stop(proc)
