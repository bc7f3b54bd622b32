"""An MCP server reached by `url` (MCP's streamable HTTP transport on loopback), on the real mcp / fastmcp
packages: the shipped example server started here as its own process (`--http PORT`), its tools listed and
called through an agent-loop episode (exact tokens), a server that dies mid-run a tool error and then an
infrastructure one until it is back, and a URL off this machine refused when the config loads."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

from hybridrl.agent.actions import ToolCall
from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.tools.base import ToolBox
from hybridrl.config import ConfigError, load_config
from hybridrl.config.fields import ConfigValueError
from hybridrl.data.episode import TaskInstance
from hybridrl.data.trajectory import TrajectoryStatus as S
from tests.envs.episodes import RecordingEngine, check_tokens
from tests.envs.test_mcp_tools import ArithTask, multiply_through_the_agent_loop
from tests.launch import ROOT

pytest.importorskip("fastmcp", reason="pip install -e .[mcp]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int) -> subprocess.Popen:
    """The example server on http://127.0.0.1:PORT/mcp, once it accepts connections."""
    proc = subprocess.Popen([sys.executable, f"{ROOT}/recipes/envs/mcp_arith_server.py", "--http", str(port)],
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the example MCP server did not listen on port {port} (exit code {proc.poll()})")


@pytest.fixture(scope="module")
def http_box():
    port = free_port()
    procs = [serve(port)]
    loop = asyncio.new_event_loop()
    try:
        cfg = ToolsConfig(pool_size=1, warm=0, audit_log="", kill_switch="",
                          mcp=[{"name": "arith", "url": f"http://127.0.0.1:{port}/mcp"}])
        tools = loop.run_until_complete(ToolBox.from_config(cfg, names=["arith_add", "arith_multiply"]).start())
        yield loop, tools, port, procs
        loop.run_until_complete(tools.close())
    finally:
        loop.close()
        for proc in procs:                # the servers this module started, whatever happened
            proc.kill()
            proc.wait()


def call(loop, tools, name, **arguments):
    return loop.run_until_complete(tools.call(ToolCall(name, arguments, raw="", format="json")))


def test_an_episode_calls_a_tool_of_a_server_on_loopback_http(http_box, tokenizer):
    loop, tools, _, _ = http_box
    assert tools.pool is None                          # nothing started in a sandbox: the server is the user's
    spec = tools.specs["arith_multiply"]
    assert spec.description == "The product a * b of two integers."
    assert spec.parameters["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    multiply_through_the_agent_loop(loop, tools, tokenizer, "mcp-http")

def test_a_server_that_dies_is_a_tool_error_then_an_infra_error_until_it_is_back(http_box):
    loop, tools, port, procs = http_box
    assert call(loop, tools, "arith_add", a=2, b=40).text == "42"
    procs[0].kill()
    procs[0].wait()
    died = call(loop, tools, "arith_add", a=1, b=1)
    assert (died.ok, died.infra_error) == (False, False) and died.error.startswith("deaths"), died
    gone = call(loop, tools, "arith_add", a=1, b=1)
    assert gone.infra_error and "is it running" in gone.error, gone          # never trained on
    procs.append(serve(port))
    back = call(loop, tools, "arith_add", a=20, b=22)
    assert back.ok and back.text == "42"                # a new session on the server that came back
    assert tools.stats()["mcp"]["arith"]["deaths"] == 1


@pytest.mark.parametrize("entry, match", [
    ({"name": "a", "url": "http://example.org:8000/mcp"}, "only a server on this machine's loopback"),
    ({"name": "a", "url": "http://127.0.0.1.example.org/mcp"}, "loopback"),
    ({"name": "a", "url": "http://10.0.0.1:80/mcp"}, "loopback"),
    ({"name": "a", "url": "http://user:secret@127.0.0.1:80/mcp"}, "no credentials"),
    ({"name": "a", "url": "ws://127.0.0.1:80/mcp"}, "a http or https URL"),
    ({"name": "a", "url": "http://127.0.0.1:80/mcp", "command": "python x.py"}, "not both"),
    ({"name": "a"}, "command line.*or url"),
])
def test_a_url_off_loopback_or_with_a_command_is_refused(entry, match):
    with pytest.raises(ConfigValueError, match=match):
        ToolsConfig(mcp=[entry])


def test_a_recipe_naming_a_server_off_loopback_is_refused_when_it_loads():
    with pytest.raises(ConfigError, match=r"tools\.mcp\[0\]\.url.*only a server on this machine's loopback"):
        load_config(None, [f"tools.mcp={json.dumps([{'name': 'a', 'url': 'https://mcp.example.org/mcp'}])}"])
