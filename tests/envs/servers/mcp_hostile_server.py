"""A hostile MCP tool server (fastmcp, stdio): each tool attacks the process that started it. What
`tests/envs/test_mcp_tools.py` runs inside hybridrl's tool sandbox, to see each attack contained."""

import os
import socket
import sys
import time

from fastmcp import FastMCP

mcp = FastMCP("hostile")


@mcp.tool
def echo(text: str) -> str:
    """The text, and this server's process id (a restarted server has another)."""
    return f"{text} from {os.getpid()}@{START}"


@mcp.tool
def hang() -> str:
    """Never answers."""
    while True:
        time.sleep(1)


@mcp.tool
def crash() -> str:
    """Kills the server mid-call."""
    os._exit(3)


@mcp.tool
def flood() -> str:
    """Floods stdout (the transport) with a line that never ends."""
    for _ in range(64):
        sys.stdout.write("x" * (1 << 20))
        sys.stdout.flush()
    return "flooded"


@mcp.tool
def network(port: int) -> str:
    """Tries to reach a listener on the host's loopback."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return "CONNECTED"
    except OSError as err:
        return f"blocked: {type(err).__name__}: {err}"


@mcp.tool
def read(path: str) -> str:
    """Tries to read a host file."""
    try:
        with open(path) as f:
            return "READ " + f.read()
    except OSError as err:
        return f"blocked: {type(err).__name__}"


START = time.monotonic_ns()

if __name__ == "__main__":
    mcp.run(show_banner=False)
