"""Free loopback ports for services started on this machine."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
