"""Free loopback ports for services started on this machine."""

import random
import socket
import threading
from pathlib import Path

# Ports are picked from here up to the kernel's ephemeral range, which the kernel never hands out itself.
LOWEST = 10000
_handed_out: set[int] = set()
_lock = threading.Lock()


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for a bind to port 0 and for outgoing connections."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the caller binds it soon after), chosen below the kernel's
    ephemeral range: a port the kernel picked would be free for it to give again to any other process's
    bind to port 0 or outgoing connection (vLLM's engine and gloo open dozens) before the caller binds
    it, as happened to a learner that binds only after its warm start. This process never hands out
    the same port twice; where the range leaves no room below it, the kernel picks."""
    low, _ = ephemeral_range()
    with _lock:
        if low - LOWEST >= 1000:
            rng = random.SystemRandom()
            for _ in range(200):
                port = rng.randrange(LOWEST, low)
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    return port
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
