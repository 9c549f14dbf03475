"""A small MCP tool server (Streamable HTTP) for the tests: `add` and `slow_add`.
Run as `python -m tests.integration.mcp_calculator PORT`."""

import sys
import time

from mcp.server.mcpserver import MCPServer

app = MCPServer("calculator")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers and return their sum."""
    return a + b


@app.tool()
def slow_add(a: int, b: int, seconds: float) -> int:
    """Add two integers, slowly."""
    time.sleep(seconds)
    return a + b


if __name__ == "__main__":
    app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
