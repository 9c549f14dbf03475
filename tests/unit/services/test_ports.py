"""free_port: ports below the kernel's ephemeral range, never the same one twice in a process."""

import socket

from rlmesh.services.ports import LOWEST, ephemeral_range, free_port


def test_free_ports_are_outside_the_range_the_kernel_hands_out_and_distinct():
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports), ports
    assert all(LOWEST <= p < low for p in ports), (ports, low)
    # What the kernel gives a bind to port 0 (as vLLM's and gloo's sockets do) is never one of them.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert low <= s.getsockname()[1] <= high
    # Each is free to bind, as the caller will.
    for p in ports[:8]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch):
    import rlmesh.services.ports as ports

    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_handed_out", set())
        picks = iter([taken, taken + 1 if taken + 1 < ephemeral_range()[0] else taken - 1])
        monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        assert free_port() != taken
