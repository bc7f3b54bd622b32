"""MCP tool servers (`tools.mcp`) on the real mcp / fastmcp packages: the shipped example server's tools listed
with their schemas and called through an agent-loop episode (exact tokens, the result the model reads), and a
hostile server's attacks (a hang, a crash, an output flood, a connection to the host, a host file) contained
inside the tool sandbox: each a tool error the model sees, the server restarted for the next call. One box for
the module (starting a fastmcp server takes a second or two)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from hybridrl.agent.actions import ToolCall
from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.mcp import SANDBOX_OWN_TEMP
from hybridrl.agent.tools.base import ToolBox
from hybridrl.config import ConfigError, load_config
from hybridrl.data.episode import TaskInstance
from hybridrl.data.trajectory import TrajectoryStatus as S
from hybridrl.envs.tasks.base import Task
from hybridrl.reward import RewardResult
from tests.envs.episodes import RecordingEngine, check_tokens
from tests.launch import ROOT

pytest.importorskip("fastmcp", reason="pip install -e .[mcp]")
if f"{ROOT}/".startswith(SANDBOX_OWN_TEMP):        # the servers below are files of the checkout
    pytest.skip(f"the checkout {ROOT} is under a temporary directory, which the tool sandbox replaces with its own, "
                "so its MCP servers cannot start (hybridrl refuses them, saying so): run from a checkout elsewhere",
                allow_module_level=True)

SERVERS = [{"name": "arith", "command": ["python", f"{ROOT}/recipes/envs/mcp_arith_server.py"]},
           {"name": "bad", "command": ["python", f"{ROOT}/tests/envs/servers/mcp_hostile_server.py"], "timeout_s": 4}]
NAMES = ["arith_add", "arith_multiply", "bad_echo", "bad_hang", "bad_crash", "bad_flood", "bad_network", "bad_read"]


@pytest.fixture(scope="module")
def scaffolded(tmp_path_factory):
    """`hybridrl init task shop --from mcp` in a directory of its own: its files and its recipe's config."""
    from hybridrl.scaffold_envs import write_env

    with tempfile.TemporaryDirectory(dir=ROOT, prefix=".scaffold-") as directory:   # not /tmp: the sandbox's own
        os.chmod(directory, 0o755)                          # readable by the sandbox's own uid
        files = write_env("shop_b", Path(directory), "mcp")
        yield files, load_config(files["grpo"])


@pytest.fixture(scope="module")
def box(tmp_path_factory, scaffolded):
    audit = tmp_path_factory.mktemp("mcp") / "audit.jsonl"
    shop = scaffolded[1].tools.mcp[0]                 # the scaffolded recipe's own server entry
    cfg = ToolsConfig(pool_size=1, warm=0, audit_log=str(audit), kill_switch="", max_output_bytes=1 << 16,
                      mcp=[*SERVERS, shop])
    loop = asyncio.new_event_loop()
    tools = loop.run_until_complete(ToolBox.from_config(cfg, names=[*NAMES, "shop-b_to_inches"]).start())
    yield loop, tools, audit
    loop.run_until_complete(tools.close())
    loop.close()


def call(box, name, **arguments):
    loop, tools, _ = box
    return loop.run_until_complete(tools.call(ToolCall(name, arguments, raw="", format="json")))


def test_the_servers_tools_are_listed_with_their_schemas(box):
    _, tools, _ = box
    spec = tools.specs["arith_multiply"]
    assert spec.description == "The product a * b of two integers."
    assert spec.parameters["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert spec.to_json()["function"]["name"] == "arith_multiply"
    assert call(box, "arith_add", a=2, b=40).text == "42"


def test_init_task_from_mcp_scaffolds_a_server_and_rows_that_call_it(box, scaffolded):
    from hybridrl.envs.tasks import get_task

    files, cfg = scaffolded
    assert cfg.tools.mcp[0]["name"] == "shop-b" and cfg.task.name == "data"
    [inst, _] = sorted(get_task("data", cfg.task).train_split(), key=lambda i: i.reference)
    assert inst.tools == ("shop-b_to_inches",)
    demo = inst.metadata["demonstration"]
    called = json.loads(demo[0]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
    result = call(box, called["name"], **called["arguments"])
    assert result.ok and result.text == demo[1]["content"] == inst.reference       # the rows agree with the server


class ArithTask(Task):
    name = "mcp_arith"
    action_formats = ("json",)

    def score(self, instance, outcome):
        return RewardResult().add("correct", float(outcome.answer == instance.reference), "test@1")


def multiply_through_the_agent_loop(loop, tools, tokenizer, run_id: str) -> None:
    """One episode "6 * 7?" whose model calls arith_multiply then answers: the tool's result reaches the
    model as an observation, the trajectory's tokens are the engine's, the reward is the task's."""
    inst = TaskInstance(task="mcp_arith", task_id=run_id, messages=({"role": "user", "content": "6 * 7?"},),
                        reference="42", tools=("arith_multiply",))
    replies = ['<tool_call>{"name": "arith_multiply", "arguments": {"a": 6, "b": 7}}</tool_call>', "<answer>42</answer>"]
    engine = RecordingEngine(tokenizer, lambda ids, turn: replies[turn], max_model_len=1 << 16)
    runner = AgentRunner(engine, tokenizer, agent_cfg=AgentConfig(max_turns=3), tools=tools, run_id=run_id)
    [traj] = loop.run_until_complete(runner.run([inst], task=ArithTask(load_config(None, []).task)))
    check_tokens(engine, [traj])
    assert traj.status == S.COMPLETED and traj.reward == 1.0
    assert [(c.name, c.ok) for c in traj.tool_calls] == [("arith_multiply", True)]
    observation = [i for i, m in zip(traj.response_ids, traj.response_mask) if not m]
    assert "42" in tokenizer.decode(observation)


def test_an_episode_calls_an_mcp_tool_through_the_agent_loop(box, tokenizer):
    loop, tools, _ = box
    multiply_through_the_agent_loop(loop, tools, tokenizer, "mcp")


def test_a_hostile_server_is_contained_and_restarted(box, tmp_path):
    _, tools, audit = box
    server = tools.mcp.servers["bad"]
    first = call(box, "bad_echo", text="hi")
    assert first.ok and first.text.startswith("hi from ")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    secret = tmp_path / "secret.txt"
    secret.write_text("host data")
    verdicts = {}
    for name, args in (("bad_hang", {}), ("bad_crash", {}), ("bad_flood", {}),
                       ("bad_network", {"port": listener.getsockname()[1]}), ("bad_read", {"path": str(secret)})):
        result = call(box, name, **args)
        verdicts[name] = (result.ok, result.infra_error, result.error or result.text)
        again = call(box, "bad_echo", text="still")         # the next call is served (by a restarted server)
        assert again.ok and again.text.startswith("still from "), (name, again)
    listener.close()
    assert not accepted                                          # no connection reached the host
    assert verdicts["bad_hang"][:2] == (False, False) and verdicts["bad_hang"][2].startswith("timeouts")
    assert verdicts["bad_crash"][:2] == (False, False) and verdicts["bad_crash"][2].startswith("deaths")
    assert verdicts["bad_flood"][:2] == (False, False) and verdicts["bad_flood"][2].startswith("floods")
    assert verdicts["bad_network"][2].startswith("blocked") and verdicts["bad_read"][2].startswith("blocked")
    assert server.counts["starts"] == 4 and tools.stats()["mcp"]["bad"]["floods"] == 1
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [r["failure"] for r in records if r["kind"] == "mcp_server_failed"] == ["timeouts", "deaths", "floods"]
    assert sum(r["kind"] == "sandbox_server" for r in records) == 6             # every start, in the sandbox
    assert not any(p.name() == "python" and "mcp_hostile" in " ".join(p.cmdline()) and p.ppid() == os.getpid()
                   for p in __import__("psutil").Process().children(recursive=True))


@pytest.mark.parametrize("servers, match", [
    ([{"name": "a_b", "command": ["python", "x.py"]}], "no '_'"),
    ([{"name": "a", "command": []}], "command line"),
    ([{"name": "a", "command": "python x.py", "colour": 1}], "must be"),
    ([{"name": "a", "command": "python x.py", "timeout_s": 0}], "timeout_s"),
])
def test_bad_servers_are_refused_at_load(servers, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"tools.mcp={json.dumps(servers)}"])


def test_without_the_package_a_server_is_refused_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)
    with pytest.raises(ConfigError, match=r"pip install -e \.\[mcp\]"):
        load_config(None, [f"tools.mcp={json.dumps(SERVERS[:1])}"])
