"""The rollout server's engine-busy clock: counts wall time with work in flight, not paused."""

from rlmesh.rollout_server import vllm_engine
from rlmesh.rollout_server.vllm_engine import BusyClock


def test_busy_clock_counts_only_time_with_requests_in_flight_and_not_paused(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(vllm_engine.time, "monotonic", lambda: now[0])
    clock = BusyClock()
    now[0] += 5  # idle: not counted
    clock.enter()
    clock.enter()  # overlapping requests count once
    now[0] += 2
    clock.exit()
    now[0] += 1
    assert clock.seconds == 3.0  # read while still busy
    clock.set_paused(True)  # paused for a weight update with a request frozen: not busy
    now[0] += 4
    clock.set_paused(False)
    now[0] += 1
    clock.exit()
    now[0] += 10
    assert clock.seconds == 4.0
