"""The gateway's defences, each by performing the attack with a real process: another user reaching the
Unix socket, a process without a key (or with a made-up or expired one), a leaked key reading another
episode, and tool code in the sandbox reaching the gateway over TCP or its socket."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.agent.testing import ScriptedEngine, calculator_oracle
from hybridrl.agent.tools.base import ToolBox
from hybridrl.config.fields import ConfigValueError
from hybridrl.envs.tasks import get_task
from hybridrl.gateway import Outcome
from hybridrl.gateway.config import GatewayConfig
from hybridrl.gateway.runner import GatewayRunner
from tests.gateway.helpers import gateway
from tests.launch import ROOT

# a process of its own: what an attacker on this machine runs (argv: JSON of what it knows)
ATTACKER = r'''
import json, socket, sys
import httpx2 as httpx

known = json.loads(sys.argv[1])
out = {}
def post(key, messages, path="/v1/chat/completions"):
    if "socket" in known:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=known["socket"]), base_url="http://x", trust_env=False)
    else:
        client = httpx.Client(base_url=known["url"].rsplit("/v1", 1)[0], trust_env=False)
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    r = client.post(path, json={"model": "p", "messages": messages}, headers=headers, timeout=60)
    return r.status_code, r.json()
msgs = [{"role": "user", "content": "hi"}]
try:
    out["no_key"] = post(None, msgs)[0]
    out["made_up"] = post("hyb-" + "x" * 32, msgs)[0]
    if "key" in known:
        status, body = post(known["key"], known["messages"])
        out["leaked"] = [status, body.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")]
except OSError as err:
    out["error"] = type(err).__name__ + ": " + str(err)
print(json.dumps(out))
'''


def attack(known: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", ATTACKER, json.dumps(known)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_gateway_listens_on_loopback_only():
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.org"):
        with pytest.raises(ConfigValueError, match="loopback only"):
            GatewayConfig(listen="tcp", host=host)
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        GatewayConfig(listen="tcp", host=host)


class Live:
    """Episodes that wait (their keys alive) while an attacker runs."""

    def __init__(self, tokenizer, listen: str):
        self.tokenizer, self.listen = tokenizer, listen
        self.release = None
        self.started: list = []

    async def agent(self, client, instance):
        reply = await client.chat.completions.create(model="policy", messages=list(instance.messages))
        self.started.append((client.api_key, list(instance.messages), reply.usage.prompt_tokens))
        await self.release.wait()
        return Outcome(answer=None)

    def run(self, during):
        async def go():
            self.release = asyncio.Event()
            task = get_task("calculator")
            engine = ScriptedEngine(self.tokenizer, calculator_oracle(self.tokenizer, calls=0))
            tools = ToolBox(cfg=ToolsConfig(kill_switch="", audit_log=""))
            runner = GatewayRunner(engine, self.tokenizer, agent_cfg=AgentConfig(), tools=tools, run_id="sec",
                                   agent=self.agent, gateway_cfg=gateway(listen=self.listen))
            episodes = asyncio.ensure_future(runner.run(task.validation_split(2), task=task))
            while len(self.started) < 2:
                await asyncio.sleep(0.01)
            try:
                result = await asyncio.to_thread(during, runner)
            finally:
                self.release.set()
            trajs = await episodes
            after = await asyncio.to_thread(during, runner)
            await runner.close()
            return result, after, trajs
        return asyncio.run(go())


def connect_as(uid: int, path: str) -> str:
    """A forked process that becomes `uid` and connects to the Unix socket at `path`: what it got."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the attacker
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(path)
            msg = "CONNECTED"
        except OSError as err:
            msg = f"{type(err).__name__} {err.errno}"
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    try:
        return os.read(r, 200).decode()
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def test_another_user_cannot_reach_the_socket(tiny_tokenizer):
    if os.geteuid() != 0:
        pytest.skip("needs root to run the attacker as another user")
    live = Live(tiny_tokenizer, "unix")

    def during(runner):
        path = runner.server.socket_path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        return connect_as(65534, str(path)), connect_as(0, str(path))

    (other, owner), _, _ = live.run(during)
    assert other.startswith("PermissionError") and owner == "CONNECTED", (other, owner)


@pytest.mark.parametrize("listen", ["unix", "tcp"])
def test_no_key_a_made_up_key_or_an_expired_one_is_refused_and_a_key_reads_only_its_episode(tiny_tokenizer, listen):
    live = Live(tiny_tokenizer, listen)
    known: dict = {}

    def during(runner):
        if not known:
            (key_a, _, _), (_, messages_b, _) = live.started
            known.update({"key": key_a, "messages": messages_b})     # A's key, B's conversation
            known.update({"socket": str(runner.server.socket_path)} if listen == "unix" else {"url": runner.server.base_url})
        return attack(known)

    during_run, after_end, trajs = live.run(during)
    assert during_run["no_key"] == 401 and during_run["made_up"] == 401
    # A's key serves A only: B's conversation is a new context in A's episode (none of B's tokens reused)
    assert during_run["leaked"] == [200, 0]
    a, b = sorted(trajs, key=lambda t: -t.metadata["gateway_requests"])
    assert (a.metadata["gateway_requests"], a.metadata["gateway_segments"]) == (2, 2)    # its own + the attacker's
    assert (b.metadata["gateway_requests"], b.metadata["gateway_segments"]) == (1, 1)    # untouched
    assert after_end["leaked"][0] == 401                  # the episode ended: its key is dead


SANDBOXED = r'''
import socket
for family, addr in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_UNIX, "{path}")):
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(3)
            s.connect(addr)
        print("CONNECTED", family.name)
    except OSError as err:
        print("REFUSED", family.name, err.errno)
s = socket.create_connection(("127.0.0.1", 3128), 5) if {proxy} else None
if s is not None:
    s.sendall(b"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n")
    print("PROXY", s.recv(100).split(b" ")[1].decode())
'''


@pytest.mark.parametrize("network", ["none", "allowlist"])
def test_tool_code_in_the_sandbox_cannot_reach_the_gateway(tiny_tokenizer, network):
    from hybridrl.agent.sandbox.pool import SandboxPool

    async def go():
        engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=0))
        tcp = GatewayRunner(engine, tiny_tokenizer, agent_cfg=AgentConfig(), tools=None, run_id="s", agent=Live.agent,
                            gateway_cfg=gateway(listen="tcp"))
        unix = GatewayRunner(engine, tiny_tokenizer, agent_cfg=AgentConfig(), tools=None, run_id="s", agent=Live.agent,
                             gateway_cfg=gateway(listen="unix"))
        await tcp.start()
        await unix.start()
        cfg = ToolsConfig(kill_switch="", audit_log="", network=network,
                          allowed_destinations=["127.0.0.1:9"] if network == "allowlist" else [])
        code = SANDBOXED.format(port=tcp.server.port, path=unix.server.socket_path, proxy=network == "allowlist")
        try:
            async with SandboxPool(cfg) as pool:
                if pool.mode == "none":
                    pytest.skip("no namespaces here: the sandbox runs tools unisolated")
                result = await pool.run(code, timeout_s=60)
        finally:
            await tcp.close()
            await unix.close()
        return result, tcp.service.counts["requests"] + unix.service.counts["requests"]

    result, reached = asyncio.run(go())
    lines = result.stdout.splitlines()
    assert result.ok, result.stderr
    assert [line.split()[0] for line in lines if not line.startswith("PROXY")] == ["REFUSED", "REFUSED"], lines
    if network == "allowlist":
        assert "PROXY 403" in lines                      # the gateway is not a declared destination
    assert reached == 0


def test_a_completion_id_is_the_same_in_every_process():
    """Completion ids name the chain a reward belongs to (`Outcome.completion`): they must not depend on the
    interpreter's salted string hashes (two processes, two PYTHONHASHSEEDs, the same ids)."""
    import os
    import subprocess
    import sys

    code = ("from types import SimpleNamespace as N; from hybridrl.gateway.service import _rid; "
            "print(_rid(N(episode_id='run-7/g3/e1', turns=2)))")
    ids = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert len(ids) == 1 and ids.pop().endswith("-3")
