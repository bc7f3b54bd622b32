"""A tiny MCP tool server (fastmcp, stdio): what `tools.mcp` starts inside hybridrl's tool sandbox.

    tools:
      mcp:
        - {name: arith, command: [python, recipes/envs/mcp_arith_server.py]}

Its tools reach the model as `arith_add` and `arith_multiply`, with the input schemas fastmcp derives
from the signatures below. Started by you with `--http PORT`, it serves MCP's streamable HTTP transport on
http://127.0.0.1:PORT/mcp instead, the server a `url` entry names:

        - {name: arith, url: "http://127.0.0.1:8765/mcp"}     # python recipes/envs/mcp_arith_server.py --http 8765
"""

import argparse

from fastmcp import FastMCP

mcp = FastMCP("arith")


@mcp.tool
def add(a: int, b: int) -> int:
    """The sum a + b of two integers."""
    return a + b


@mcp.tool
def multiply(a: int, b: int) -> int:
    """The product a * b of two integers."""
    return a * b


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=int, metavar="PORT", help="serve http://127.0.0.1:PORT/mcp (default: stdio)")
    port = parser.parse_args().http
    if port is None:
        mcp.run(show_banner=False)    # stdio: JSON-RPC on stdin / stdout
    else:
        mcp.run("http", show_banner=False, host="127.0.0.1", port=port, log_level="warning")
