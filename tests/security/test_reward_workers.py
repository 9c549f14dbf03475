"""User reward functions run in worker processes the reward server can kill: one that allocates
without bound, or never returns (spinning or sleeping), fails its own items and its worker is
killed and replaced, while other calls are answered; a Score is answered within
reward.score_timeout_s whatever the caller's deadline; workers get no credentials from the server's
environment; the function's health entry says NOT_SERVING while its workers are stuck. A real
reward server on a loopback port, real worker processes."""

import asyncio
import os
import re
import sys
import time


import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.reward_server.function_workers import WorkerLimits
from rlmesh.reward_server.server import SERVICE_NAME, report_function_health
from rlmesh.reward_server.service import SCORE_MARGIN_S, RewardService
from rlmesh.services.config import RewardSection
from rlmesh.services.grpc_client import make_channel
from rlmesh.services.grpc_server import start_server
from rlmesh.v1 import reward_pb2, reward_pb2_grpc

pytestmark = pytest.mark.security
FNS = "tests.security.reward_fns"
SECRET = "s3cret-token-value"


def limits(**keys) -> WorkerLimits:
    """Worker limits from `reward` keys (the rest at their config defaults)."""
    return WorkerLimits.from_config(RewardSection(**keys))


@pytest_asyncio.fixture(loop_scope="session")
async def reward():
    os.environ["RLMESH_TOKEN"] = SECRET  # what a worker must not inherit
    os.environ["RLMESH_QUEUE_PASSWORD"] = SECRET
    try:
        service = RewardService({name: f"{FNS}:{name}" for name in ("hog", "spin", "sleeper", "secrets_seen", "ok")},
                                builtin=["arithmetic"], env_timeout_s=5.0, env_max_concurrency=4,
                                function_limits=limits(function_workers=1, function_memory_mb=256, function_cpu_s=30.0,
                                                      env_timeout_s=5.0))
    finally:
        del os.environ["RLMESH_TOKEN"], os.environ["RLMESH_QUEUE_PASSWORD"]
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service, SERVICE_NAME)],
                                port=0)
    health = asyncio.create_task(report_function_health(service, server, period_s=0.2))
    async with make_channel(f"127.0.0.1:{server.port}") as channel:
        yield service, reward_pb2_grpc.RewardServiceStub(channel), health_pb2_grpc.HealthStub(channel)
    health.cancel()
    await server.stop(0)
    for env in service.local.values():
        if hasattr(env, "close"):
            env.close()


ARITHMETIC = reward_pb2.ScoreItem(id="a", env_name="arithmetic", completion="2")
ARITHMETIC.env_metadata.update({"answer": "2"})


def _items(env: str, n: int = 1) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id=str(i), env_name=env, completion="x")
                                          for i in range(n)])


def _pid(env) -> int:
    (worker,) = env.workers._all
    return worker.proc.pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _answered_meanwhile(stub, until: asyncio.Future) -> int:
    """Score `ok` and a built-in over and over while `until` runs; each answer must come fast."""
    count = 0
    while not until.done():
        t0 = time.monotonic()
        reply = await stub.Score(_items("ok"), timeout=5)
        builtin = await stub.Score(reward_pb2.ScoreRequest(items=[ARITHMETIC]), timeout=5)
        assert reply.results[0].reward == 1.0 and not reply.results[0].error
        assert builtin.results[0].reward == 1.0 and time.monotonic() - t0 < 1.0
        count += 1
        await asyncio.sleep(0.05)
    return count


async def test_a_worker_gets_no_credentials_from_the_server_environment(reward):
    _, stub, _ = reward
    assert FNS not in sys.modules, "the reward functions' module is imported in the workers only"
    reply = await stub.Score(_items("secrets_seen"), timeout=10)
    assert not reply.results[0].error and reply.results[0].reward == 0.0
    with open(f"/proc/{int(reply.results[0].components['pid'])}/environ", "rb") as f:
        assert SECRET.encode() not in f.read()


async def test_a_function_that_allocates_without_bound_is_stopped_and_its_worker_replaced(reward):
    service, stub, _ = reward
    env = service.local["hog"]
    before = _pid(env)
    call = asyncio.ensure_future(stub.Score(_items("hog"), timeout=20))
    assert await _answered_meanwhile(stub, call) >= 1
    error = (await call).results[0].error
    assert "reward.function_memory_mb=256" in error, error
    for _ in range(100):
        if env.workers._all and _pid(env) != before:
            break
        await asyncio.sleep(0.1)
    assert _pid(env) != before and not _alive(before) and env.workers.num_replaced >= 1


@pytest.mark.parametrize("name", ["spin", "sleeper"])
async def test_a_function_that_never_returns_is_killed_and_replaced(reward, name):
    service, stub, health = reward
    env = service.local[name]
    before = _pid(env)
    t0 = time.monotonic()
    call = asyncio.ensure_future(stub.Score(_items(name), timeout=20))
    seen_not_serving = False

    async def watch_health():
        nonlocal seen_not_serving
        while not call.done():
            status = (await health.Check(health_pb2.HealthCheckRequest(service=f"{SERVICE_NAME}/{name}"))).status
            seen_not_serving |= status == health_pb2.HealthCheckResponse.NOT_SERVING
            await asyncio.sleep(0.1)

    watcher = asyncio.ensure_future(watch_health())
    assert await _answered_meanwhile(stub, call) >= 3
    await watcher
    error = (await call).results[0].error
    assert "did not return within 5s" in error, error
    assert time.monotonic() - t0 < 9.0
    assert seen_not_serving, "health says NOT_SERVING while the only worker is stuck"
    for _ in range(100):
        if env.workers._all and _pid(env) != before and not _alive(before):
            break
        await asyncio.sleep(0.1)
    assert _pid(env) != before and not _alive(before), "the stuck worker is killed and a new one started"
    for _ in range(30):  # serving again once the replacement is up
        status = (await health.Check(health_pb2.HealthCheckRequest(service=f"{SERVICE_NAME}/{name}"))).status
        if status == health_pb2.HealthCheckResponse.SERVING:
            break
        await asyncio.sleep(0.2)
    assert status == health_pb2.HealthCheckResponse.SERVING


async def test_a_hung_function_is_answered_within_score_timeout_s_whatever_the_caller_waits():
    """reward.score_timeout_s=2 below env_timeout_s=8, and a caller that sets no deadline: a Score
    of three items of a function that never returns (one worker, so two wait for it) comes back
    within 2 s + SCORE_MARGIN_S, each item failed saying what missed the time it had (at most 1.8 s,
    90% of 2 s), and the stuck worker is killed then, not when env_timeout_s runs out."""
    service = RewardService({"sleeper": f"{FNS}:sleeper"}, builtin=[], score_timeout_s=2.0, env_timeout_s=8.0,
                            function_limits=limits(function_workers=1, function_memory_mb=256, env_timeout_s=8.0))
    server = await start_server([(reward_pb2_grpc.add_RewardServiceServicer_to_server, service, SERVICE_NAME)],
                                port=0)
    env = service.local["sleeper"]
    try:
        before = _pid(env)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            t0 = time.monotonic()
            reply = await reward_pb2_grpc.RewardServiceStub(channel).Score(_items("sleeper", 3))  # no deadline
            elapsed = time.monotonic() - t0
        assert elapsed < 2.0 + SCORE_MARGIN_S, f"answered after {elapsed:.1f}s"
        assert [r.id for r in reply.results] == ["0", "1", "2"]
        for result in reply.results:  # an error, so the sample is dropped, never trained on as reward 0
            assert re.search(r"(did not return|no free worker) within 1\.\d+s", result.error), result.error
        for _ in range(10):
            if not _alive(before):
                break
            await asyncio.sleep(0.1)
        assert not _alive(before), "the stuck worker is killed when the Score is answered"
    finally:
        await server.stop(0)
        env.close()


async def test_a_call_over_its_cpu_seconds_is_killed_by_the_kernel():
    from rlmesh.reward_server.function_workers import FunctionWorkerPool

    pool = FunctionWorkerPool("spin", f"{FNS}:spin", limits(function_workers=1, function_cpu_s=1.0, env_timeout_s=30.0))
    try:
        t0 = time.monotonic()
        answer = await asyncio.to_thread(pool.call, {"prompt": [], "completion": "x", "metadata": {}})
        assert "reward.function_cpu_s=1" in answer["error"] and time.monotonic() - t0 < 10
        assert pool.num_replaced == 1
    finally:
        pool.close()


def test_a_function_that_cannot_be_imported_fails_at_start_up_naming_it():
    from rlmesh.reward_server.function_workers import FunctionWorkerPool

    with pytest.raises(ValueError, match="no_such_module"):
        FunctionWorkerPool("bad", "no_such_module:fn", limits(function_workers=1))


def test_rlmesh_reward_with_a_function_it_cannot_import_says_so_in_one_line():
    """The command's user sees the reason and exit 1, not a traceback through the event loop."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rlmesh.cli", "reward", "--port", "0",
                          "reward.functions={bad: 'no_such_module:fn'}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == ("rlmesh reward: reward function 'no_such_module:fn': cannot import "
                                                   "'no_such_module' (No module named 'no_such_module')")
    assert "Traceback" not in out.stderr




def test_a_function_that_writes_into_the_answer_pipe_fails_its_item_and_its_worker_is_replaced():
    from rlmesh.reward_server.function_workers import FunctionWorkerPool

    pool = FunctionWorkerPool("scribbler", f"{FNS}:scribbler", limits(function_workers=1, env_timeout_s=10.0))
    try:
        answer = pool.call({"prompt": [], "completion": "x", "metadata": {}})
        assert "not an answer" in answer["error"] and pool.num_replaced == 1
    finally:
        pool.close()
