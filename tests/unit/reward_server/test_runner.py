import asyncio
import threading
import time

import pytest

from rlmesh.reward_server.runner import EnvironmentTimeout, EnvRunner


async def test_returns_results_and_raises_the_calls_errors():
    runner = EnvRunner("e", max_concurrency=2, timeout_s=5)
    assert await runner.call("score", lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(KeyError, match="x"):
        await runner.call("score", lambda: {}["x"])


async def test_a_hung_call_times_out_and_keeps_its_slot_until_it_returns():
    release = threading.Event()
    runner = EnvRunner("hang", max_concurrency=1, timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(EnvironmentTimeout, match="'hang' step did not return within 0.2s"):
        await runner.call("step", release.wait)
    assert time.monotonic() - t0 < 1.0
    assert runner.num_overdue == 1
    # The only worker is still stuck: the next call cannot start and says why.
    with pytest.raises(EnvironmentTimeout, match="no free worker.*1 of them with calls past their deadline"):
        await runner.call("score", lambda: 1)
    release.set()
    for _ in range(100):
        if runner.num_overdue == 0:
            break
        await asyncio.sleep(0.01)
    assert runner.num_overdue == 0
    assert await runner.call("score", lambda: 1) == 1, "the slot came back when the call returned"


async def test_stuck_calls_of_one_environment_do_not_block_another():
    release = threading.Event()
    stuck = EnvRunner("stuck", max_concurrency=2, timeout_s=0.2)
    other = EnvRunner("other", max_concurrency=2, timeout_s=0.2)
    hung = [asyncio.ensure_future(stuck.call("score", release.wait)) for _ in range(2)]
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    assert await asyncio.gather(*(other.call("score", lambda i=i: i) for i in range(10))) == list(range(10))
    assert time.monotonic() - t0 < 0.15, "served while the other environment's workers hang"
    assert all(isinstance(r, EnvironmentTimeout) for r in await asyncio.gather(*hung, return_exceptions=True))
    release.set()


async def test_per_call_timeout_is_capped_by_the_runners():
    runner = EnvRunner("e", max_concurrency=1, timeout_s=0.1)
    with pytest.raises(EnvironmentTimeout, match="within 0.1s"):
        await runner.call("score", time.sleep, 0.5, timeout_s=10)
    with pytest.raises(EnvironmentTimeout, match="within 0.05s"):
        await runner.call("score", time.sleep, 0.5, timeout_s=0.05)


async def test_concurrency_is_bounded():
    runner = EnvRunner("e", max_concurrency=3, timeout_s=5)
    lock, running, peak = threading.Lock(), [0], [0]

    def work():
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1

    await asyncio.gather(*(runner.call("score", work) for _ in range(12)))
    assert peak[0] == 3


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="max_concurrency must be >= 1"):
        EnvRunner("e", max_concurrency=0, timeout_s=1)


async def test_a_free_worker_serves_the_next_call_while_another_hangs():
    release = threading.Event()
    runner = EnvRunner("e", max_concurrency=2, timeout_s=0.5)
    hung = asyncio.ensure_future(runner.call("score", release.wait))
    assert await runner.call("score", lambda: "served") == "served"
    release.set()
    assert await hung is True
