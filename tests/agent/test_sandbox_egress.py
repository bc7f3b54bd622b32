"""Allow-listed egress (tools.network=allowlist): a tool reaches its one declared loopback
destination through the pool's CONNECT proxy (a raw tunnel and http.client's own tunnelling);
every other address, IPv6, host unix sockets and AF_VSOCK are refused; the audit log holds every
attempt through the proxy, with its verdict and bytes, in an intact chain. As root and as an
unprivileged user (userns mode)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

from hybridrl.agent.config import ToolsConfig
from hybridrl.telemetry.audit import records, verify
from tests.launch import ROOT

# what the tool does (str.format'ed with the ports and paths)
TOOL = r'''
import http.client, os, socket

def connect(target):
    s = socket.create_connection(("127.0.0.1", 3128), 5)
    s.sendall(f"CONNECT {{target}} HTTP/1.1\r\nHost: {{target}}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1024)
        if not chunk:
            break
        head += chunk
    return s, head.split(b" ")[1].decode() if head else "closed"

s, code = connect("127.0.0.1:{port}")
s.sendall(b"ping")
print("ALLOWED", code, s.recv(100).decode())
s.close()
conn = http.client.HTTPConnection("127.0.0.1", 3128, timeout=5)         # a standard client, tunnelling
conn.set_tunnel("127.0.0.1", {http_port})
conn.request("GET", "/hello")
print("HTTP", conn.getresponse().status)
for target in ("127.0.0.1:{other_port}", "[::1]:{port}", "10.0.0.1:80", "localhost:{port}", "unix:{host_socket}"):
    print("PROXY", target, connect(target)[1])
conn = socket.create_connection(("127.0.0.1", 3128), 5)
conn.sendall(b"GET http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n")
print("PROXY GET", conn.recv(100).split(b" ")[1].decode())
for family, addr in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET, ("10.0.0.1", 80)),
                     (socket.AF_INET6, ("::1", {port})), (socket.AF_UNIX, "{host_socket}")):
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(3)
            s.connect(addr)
        print("DIRECT CONNECTED", addr)
    except OSError as err:
        print("DIRECT refused", family.name, err.errno)
try:
    socket.socket(40, socket.SOCK_STREAM)                       # AF_VSOCK: created, never connected
    print("VSOCK CREATED")
except OSError as err:
    print("VSOCK refused", err.errno)
print("DONE")
'''

POOL = """
import asyncio, json, sys
from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox.pool import SandboxPool
from hybridrl.agent.tools.base import TOOL_CALL

async def main(cfg, code):
    async with SandboxPool(cfg) as pool:
        TOOL_CALL.set({"episode": "ep-1", "call": "t0.0"})
        r = await pool.run(code, timeout_s=60)
        return {"mode": pool.mode, "stdout": r.stdout, "stderr": r.stderr, "ok": r.ok, "egress": pool.stats()["egress"]}

cfg = ToolsConfig(**json.loads(sys.argv[1]))
print(json.dumps(asyncio.run(main(cfg, sys.argv[2]))))
"""


class Servers:
    """An echo server (the allowed destination), an HTTP server, another listener that must stay
    untouched, and a unix socket on the host; each counts what reached it."""

    def __init__(self, tmp: str):
        self.hits = {"echo": 0, "other": 0, "unix": 0, "http": 0}
        self.echo, self.port = self._listen(socket.AF_INET, ("127.0.0.1", 0), "echo")
        self.other, self.other_port = self._listen(socket.AF_INET, ("127.0.0.1", 0), "other")
        self.http, self.http_port = self._listen(socket.AF_INET, ("127.0.0.1", 0), "http")
        self.host_socket = os.path.join(tmp, "host.sock")
        self.unix, _ = self._listen(socket.AF_UNIX, self.host_socket, "unix")

    def _listen(self, family, addr, name):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.bind(addr)
        s.listen(8)
        threading.Thread(target=self._serve, args=(s, name), daemon=True).start()
        return s, (s.getsockname()[1] if family == socket.AF_INET else None)

    def _serve(self, s, name):
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            self.hits[name] += 1
            with conn:
                data = conn.recv(1024)
                if name == "http":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                elif data:
                    conn.sendall(data)

    def close(self):
        for s in (self.echo, self.other, self.http, self.unix):
            s.close()


def check(out: dict, servers: Servers, audit_path: str, port: int) -> None:
    assert out["ok"], out["stderr"]
    lines = out["stdout"].splitlines()
    assert f"ALLOWED 200 ping" in lines and "HTTP 200" in lines
    proxy = {line.split()[1]: line.split()[2] for line in lines if line.startswith("PROXY ") and "GET" not in line}
    assert set(proxy.values()) == {"403"}, proxy                      # not declared: refused by the proxy
    assert "PROXY GET 405" in lines                                     # only CONNECT
    direct = [line for line in lines if line.startswith("DIRECT")]
    assert len(direct) == 4 and all("refused" in line for line in direct), direct
    assert "VSOCK refused 97" in lines
    assert servers.hits["echo"] == 1 and servers.hits["http"] == 1
    assert servers.hits["other"] == 0 and servers.hits["unix"] == 0
    egress = [r for r in records(audit_path) if r["kind"] == "egress"]
    verdicts = {r["destination"]: r["verdict"] for r in egress}
    assert verdicts[f"127.0.0.1:{port}"] == "allowed" and verdicts[f"127.0.0.1:{servers.http_port}"] == "allowed"
    assert {v for d, v in verdicts.items() if d not in (f"127.0.0.1:{port}", f"127.0.0.1:{servers.http_port}")} \
        == {"refused: not an allowed destination", "refused: only CONNECT is proxied"}
    assert len(egress) == 8 and all(r["episode"] == "ep-1" and r["call"] == "t0.0" for r in egress)
    echo = next(r for r in egress if r["destination"] == f"127.0.0.1:{port}")
    assert echo["bytes_out"] == 4 and echo["bytes_in"] == 4
    assert out["egress"] == {"allowed": 2, "refused": 6, "over_cap": 0}
    assert verify(audit_path)[0]


def _cfg(servers: Servers, audit_path: str, **kwargs) -> dict:
    return dict(pool_size=1, warm=0, memory_mb=256, network="allowlist", audit_log=audit_path,
                allowed_destinations=[f"127.0.0.1:{servers.port}", f"127.0.0.1:{servers.http_port}"], **kwargs)


def _code(servers: Servers) -> str:
    return TOOL.format(port=servers.port, other_port=servers.other_port, http_port=servers.http_port,
                       host_socket=servers.host_socket)


def test_egress_through_the_proxy_only_to_the_declared_destination_as_root(tmp_path):
    import asyncio

    if os.geteuid() != 0:
        pytest.skip("the root-mode case needs root (the userns case below runs as an unprivileged user)")
    servers = Servers(str(tmp_path))
    audit_path = str(tmp_path / "audit.jsonl")
    namespace: dict = {}
    exec(POOL.split("cfg = ToolsConfig")[0], namespace)           # the same driver, in this process
    try:
        out = asyncio.run(namespace["main"](ToolsConfig(**_cfg(servers, audit_path)), _code(servers)))
    finally:
        servers.close()
    assert out["mode"] == "root"
    check(out, servers, audit_path, servers.port)


def test_egress_through_the_proxy_only_to_the_declared_destination_in_userns_mode():
    python = shutil.which("python3", path="/usr/bin:/bin")
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or not python or not setpriv:
        pytest.skip("needs root (to become an unprivileged user), setpriv and a system python3")
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True).stdout.strip()
    if version != str(tuple(sys.version_info[:2])):
        pytest.skip(f"system python {version} cannot load this venv's packages")
    tmp = tempfile.mkdtemp(prefix="hybridrl-egress-")
    os.chmod(tmp, 0o777)
    servers = Servers(tmp)
    audit_path = os.path.join(tmp, "audit.jsonl")
    site = [p for p in sys.path if p.endswith("site-packages") and ".venv" in p]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": os.pathsep.join([str(ROOT), *site])}
    try:
        proc = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c", POOL,
                               json.dumps(_cfg(servers, audit_path, python=python)), _code(servers)],
                              env=env, cwd="/", capture_output=True, text=True, timeout=300)
        if "Operation not permitted" in proc.stderr and "userns" not in proc.stdout:
            pytest.skip("unprivileged user namespaces are disabled here")
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["mode"] == "userns"
        check(out, servers, audit_path, servers.port)
    finally:
        servers.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_allowlist_needs_destinations_and_namespaces():
    from hybridrl.config.fields import ConfigValueError

    with pytest.raises(ConfigValueError, match="at least one"):
        ToolsConfig(network="allowlist")
    for bad in ("example.com", "::1:80", "unix:relative", "host:0"):
        with pytest.raises(ConfigValueError) as err:
            ToolsConfig(network="allowlist", allowed_destinations=[bad])
        assert err.value.field == "allowed_destinations"
