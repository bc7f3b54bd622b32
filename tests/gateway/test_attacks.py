"""`hybridrl gateway check`: the gateway's attack set performed over real sockets from this process against a
gateway in a process of its own (malformed bodies of every kind, 100 MiB bodies with the server's RSS sampled,
1.3 MiB of text, special tokens in every role, slow and idle connections, an abandoned upload), then the held
episode's status read back from the gateway."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridrl.cli import main
from hybridrl.gateway.attacks import NAMES, RSS_LIMIT_MIB, Target, run_attacks
from tests.launch import ROOT


def test_gateway_check_contains_every_attack(capsys):
    rc = main(["gateway", "check", "gateway.read_timeout_s=1", "--json"])
    out = json.loads(capsys.readouterr().out)
    attacks = out["attacks"]
    assert rc == 0 and out["failed"] == [], {k: v for k, v in attacks.items() if v["status"] != "PASS"}
    assert sorted(attacks) == sorted([*NAMES, "episode_not_invalid"])
    assert all(v["status"] == "PASS" for v in attacks.values())
    for name in ("body_100mb_declared", "body_100mb_chunked", "text_1_3mib"):
        assert attacks[name]["http_status"] in (413, 400) and 0 <= attacks[name]["rss_grew_mib"] < RSS_LIMIT_MIB
    report = attacks["episode_not_invalid"]["report"]
    assert report["statuses"] == ["completed"] and report["service"]["errors"] == 0
    assert report["timed_out"] >= 36                      # the idle, slow-header and slow-body connections
    assert report["service"]["client_closed"] >= 1        # the abandoned upload: a 499, nothing committed


@pytest.mark.slow                    # a second gateway process: ~4 s of CPU
def test_gateway_check_against_a_running_gateway(capsys):
    """--socket/--key/--pid: a gateway someone else started (here the same target, started by hand)."""
    target = subprocess.Popen([sys.executable, "-m", "hybridrl.gateway.check_target", '{"read_timeout_s": 1}'],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        hello = json.loads(target.stdout.readline())
        rc = main(["gateway", "check", "--socket", hello["socket"], "--key", hello["key"], "--pid", str(hello["pid"]),
                   "gateway.read_timeout_s=1", "--attack", "malformed", "--attack", "slow_body", "--attack",
                   "text_1_3mib"])
        out = capsys.readouterr().out
        rows = [line.split()[:2] for line in out.splitlines() if line[:4] in ("PASS", "FAIL")]
        assert rc == 0 and len(rows) == len([n for n in NAMES if n.startswith("malformed:")]) + 2, out
        assert all(status == "PASS" for status, _ in rows), out
        target.stdin.write("end\n")
        target.stdin.close()
        report = json.loads(target.stdout.readline())
        assert report["statuses"] == ["completed"] and report["service"]["errors"] == 0 and report["timed_out"] == 4
        assert main(["gateway", "check", "--socket", hello["socket"]]) == 2
        assert "--key" in capsys.readouterr().err
    finally:
        if target.poll() is None:
            target.kill()
        target.wait(timeout=30)


def test_a_server_that_holds_slow_clients_fails_the_check():
    """The check can fail: a plain socket server that accepts and never closes holds every slow client."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list = []
    threading.Thread(target=_accept_forever, args=(server, held), daemon=True).start()
    try:
        verdicts = run_attacks(Target(port=server.getsockname()[1], key="k", read_timeout_s=0.2), ["idle_connections"])
    finally:
        server.close()
    assert [(v.name, v.status) for v in verdicts] == [("idle_connections", "FAIL")]


def _accept_forever(server, held):
    while True:
        try:
            held.append(server.accept()[0])
        except OSError:
            return


@pytest.mark.slow                    # two more gateway processes: ~8 s of CPU
def test_special_tokens_in_every_role_with_a_llama3_template(tmp_path, styled, capsys):
    """With Llama-3's template (an `ipython` role, <|eot_id|> and <|start_header_id|> special): the markers are
    text in every role; with gateway.special_tokens_in_messages=special (the opt-out) the check sees them as
    special ids in the system and user messages and fails (tool and ipython outputs stay text)."""
    model = tmp_path / "llama3"
    styled("llama3").save_pretrained(model)
    rows = {}
    for mode in ("text", "special"):
        rc = main(["gateway", "check", "--model", str(model), f"gateway.special_tokens_in_messages={mode}", "--json",
                   "--attack", "special_tokens"])
        out = json.loads(capsys.readouterr().out)
        rows[mode] = (rc, {k: v["status"] for k, v in out["attacks"].items() if k.startswith("special_tokens:")})
    roles = ["special_tokens:system", "special_tokens:user", "special_tokens:tool", "special_tokens:ipython"]
    assert rows["text"] == (0, {r: "PASS" for r in roles}), rows
    assert rows["special"] == (1, {"special_tokens:system": "FAIL", "special_tokens:user": "FAIL",   # the opt-out
                                   "special_tokens:tool": "PASS", "special_tokens:ipython": "PASS"}), rows
    # a tool's output is made text whatever the setting
