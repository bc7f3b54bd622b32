"""A tiny MCP tool server (fastmcp, stdio): what `tools.mcp` starts inside hybridrl's tool sandbox.

    tools:
      mcp:
        - {name: arith, command: [python, recipes/envs/mcp_arith_server.py]}

Its tools reach the model as `arith_add` and `arith_multiply`, with the input schemas fastmcp derives
from the signatures below.
"""

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
    mcp.run(show_banner=False)        # stdio: JSON-RPC on stdin / stdout
