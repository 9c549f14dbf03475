"""A service given a fixed port binds it even if something holds it for a moment (a local client
dialling that port can be handed it as its own source port), and says what to do when it stays busy."""

import asyncio
import socket

import pytest

from rlmesh.services import grpc_server
from rlmesh.services.grpc_server import start_server


def _occupy() -> socket.socket:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    return holder


async def test_a_port_held_for_a_moment_is_bound_once_it_is_free():
    holder = _occupy()
    port = holder.getsockname()[1]
    asyncio.get_running_loop().call_later(1.0, holder.close)
    server = await asyncio.wait_for(start_server([], port=port), 15)
    try:
        assert server.port == port
    finally:
        await server.stop(0)


async def test_a_port_that_stays_busy_fails_with_a_clear_error(monkeypatch):
    monkeypatch.setattr(grpc_server, "BIND_RETRY_S", 1.0)
    holder = _occupy()
    try:
        with pytest.raises(OSError, match="could not bind gRPC server to 127.0.0.1:.*port in use"):
            await start_server([], port=holder.getsockname()[1])
    finally:
        holder.close()
