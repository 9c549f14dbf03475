"""Start the tests' environment servers (a real OpenEnv server, a real MCP server) as processes of
their own, and wait until they accept connections."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _start(module: str, port: int, what: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", module, str(port)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 90
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        assert proc.poll() is None and time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.2)


def start_mcp_server(port: int) -> subprocess.Popen:
    """tests/integration/mcp_calculator.py: Streamable HTTP at http://127.0.0.1:PORT/mcp."""
    return _start("tests.integration.mcp_calculator", port, "MCP server")


def start_openenv_server(port: int) -> subprocess.Popen:
    """tests/integration/openenv_guess.py: an OpenEnv server at http://127.0.0.1:PORT."""
    return _start("tests.integration.openenv_guess", port, "OpenEnv server")
