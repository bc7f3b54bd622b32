"""`hybridrl gateway check`: the gateway's attack set (hybridrl/gateway/attacks.py), PASS/FAIL per attack.

    hybridrl gateway check [RECIPE | --config RECIPE] [gateway.k=v ...] [--model DIR] [--json] [--attack NAME ...]
    hybridrl gateway check --socket PATH | --url http://127.0.0.1:PORT  --key KEY [--pid PID] ...

Without --socket / --url it starts a gateway with the recipe's `gateway` section in a process of its own (a
scripted engine, the tokenizer of --model or a tiny one, one held episode whose key the attacker is given),
attacks it from this process, and reads the episode's status back at the end. With them it attacks a gateway
that is already running, with an episode key of it (--pid: its process, for the memory figures).
Exit 1 when an attack was not contained.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import threading
from typing import Any
from urllib.parse import urlparse

from hybridrl.config.cli import add_recipe_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gateway_command", required=True)
    p = sub.add_parser("check", help="run the attack set against a gateway (a fresh one unless --socket/--url): "
                                     "PASS/FAIL per attack, exit 1 on any FAIL")
    add_recipe_arguments(p)
    p.add_argument("--socket", default=None, help="a running gateway's Unix socket")
    p.add_argument("--url", default=None, help="a running gateway's loopback URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--key", default=None, help="an episode key of the running gateway")
    p.add_argument("--pid", type=int, default=None, help="the running gateway's process (its memory is sampled)")
    p.add_argument("--model", default=None, help="the fresh gateway's tokenizer (default: a tiny ChatML one)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--attack", action="append", default=[], metavar="NAME",
                   help="run only this attack, or a family (malformed, special_tokens); repeatable")


def main(args: argparse.Namespace) -> int:
    from hybridrl.config import ConfigError, load_config
    from hybridrl.config.cli import recipe_and_overrides
    from hybridrl.gateway.attacks import NAMES, run_attacks

    try:
        cfg = load_config(*recipe_and_overrides(args.recipe_args, args.config))
    except ConfigError as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return 2
    names = args.attack or None
    unknown = sorted(n for n in names or () if n not in NAMES and n not in {x.split(":")[0] for x in NAMES})
    if unknown:
        print(f"hybridrl: unknown attack(s) {unknown}; known: {NAMES}", file=sys.stderr)
        return 2
    if args.socket or args.url:
        if not args.key:
            print("hybridrl: --key KEY: an episode key of the running gateway is needed", file=sys.stderr)
            return 2
        target = _running(args, cfg.gateway.read_timeout_s)
        verdicts = run_attacks(target, names)
        where = args.socket or args.url
    else:
        verdicts, where = _fresh(cfg.gateway, args.model, names)
        if verdicts is None:
            return 1
    return _print(verdicts, where, as_json=args.json)


def _running(args: argparse.Namespace, read_timeout_s: float) -> Any:
    from hybridrl.gateway.attacks import Target

    if args.socket:
        return Target(socket=args.socket, key=args.key, pid=args.pid, read_timeout_s=read_timeout_s)
    url = urlparse(args.url)
    return Target(host=url.hostname or "127.0.0.1", port=url.port or 80, key=args.key, pid=args.pid,
                  read_timeout_s=read_timeout_s)


def _fresh(gateway_cfg: Any, model: str | None, names: list[str] | None) -> tuple[list | None, str]:
    """Start the target process, attack it, end its episode and add the verdict on its report."""
    from hybridrl.gateway.attacks import Target, episode_verdict, run_attacks

    cmd = [sys.executable, "-m", "hybridrl.gateway.check_target", json.dumps(dataclasses.asdict(gateway_cfg))]
    proc = subprocess.Popen(cmd + ([model] if model else []), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        hello = _line(proc, timeout_s=180)
        if hello is None or '"key"' not in hello:
            print(f"FAIL the gateway did not start: {hello or 'no answer'}")
            return None, ""
        target = Target(**json.loads(hello))
        verdicts = run_attacks(target, names)
        proc.stdin.write("end\n")
        proc.stdin.close()
        report = _line(proc, timeout_s=60)
        verdicts.append(episode_verdict(json.loads(report) if report else {}))
        return verdicts, target.socket or f"127.0.0.1:{target.port}"
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)


def _line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """The target's next line of stdout, or None if it exits or says nothing in time."""
    out: list[str] = []
    reader = threading.Thread(target=_read_into, args=(proc.stdout, out), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out[0].strip() or None if out else None


def _read_into(stream: Any, out: list[str]) -> None:
    out.append(stream.readline())


def _print(verdicts: list, where: str, *, as_json: bool) -> int:
    failed = [v.name for v in verdicts if v.status == "FAIL"]
    if as_json:
        print(json.dumps({"gateway": where, "failed": failed, "attacks": {
            v.name: {"status": v.status, "what": v.what, "detail": v.detail, **v.figures} for v in verdicts}},
            indent=2, default=str))
    else:
        print(f"gateway: {where}")
        width = max(len(v.name) for v in verdicts)
        for v in verdicts:
            print(f"{v.status:4s} {v.name:{width}s} {v.what}")
            print(f"     {'':{width}s} {v.detail}")
        print(f"{len(verdicts) - len(failed)}/{len(verdicts)} attacks contained" if not failed
              else f"{len(failed)} attack(s) NOT contained: {', '.join(failed)}")
    return 1 if failed else 0
