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


@pytest.mark.parametrize("escape", ["\\ud800", "\\uDFFF", "\\uDbFf"])
@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-32"])
def test_a_lone_surrogate_is_refused_wherever_it_is_and_however_the_body_is_encoded(escape, encoding):
    """The body's text is walked only when it can hold a lone surrogate (an escape, or a body that is not
    UTF-8): in a value, a key or a list, escaped in any case, in every encoding json.loads reads."""
    from hybridrl.gateway.episodes import GatewayError
    from hybridrl.gateway.validate import parse_body
    for body in (f'{{"messages": [{{"role": "user", "content": "a{escape}b"}}]}}',
                 f'{{"metadata": {{"k{escape}": 1}}}}', f'{{"stop": ["x", "{escape}"]}}'):
        with pytest.raises(GatewayError, match="lone surrogate"):
            parse_body(body.encode(encoding))
    pair = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800 \\u00e9"}]}'
    assert parse_body(pair.encode(encoding))["messages"][0]["content"] == "\U0001F600 \\ud800 \u00e9"


def test_the_request_text_limit_counts_the_text_whenever_the_body_could_hold_more():
    """The body's size bounds its text: a body within gateway.max_request_chars is not walked, a larger one is,
    and its text over the limit is refused naming the knob (escapes make a body longer than its text)."""
    from hybridrl.gateway.episodes import GatewayError
    from hybridrl.gateway.validate import check_request, parse_body
    for text, refused in (("x" * 97, True), ("\u00e9" * 30, False), ("x" * 96, False)):   # + "user": 101, 34, 100
        raw = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
        body = parse_body(raw)
        assert len(raw) > 100
        if refused:
            with pytest.raises(GatewayError, match="max_request_chars=100"):
                check_request(body, chat=True, max_chars=100, body_bytes=len(raw))
        else:
            check_request(body, chat=True, max_chars=100, body_bytes=len(raw))
    check_request({"messages": [{"role": "user", "content": "x" * 101}]}, chat=True, max_chars=200, body_bytes=150)
    with pytest.raises(GatewayError, match="max_request_chars=100"):
        check_request({"messages": [{"role": "user", "content": "x" * 101}]}, chat=True, max_chars=100)
