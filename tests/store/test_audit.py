"""The run's audit log: appends from several processes form one chain, and the chain shows an
edited, inserted or removed line."""

from __future__ import annotations

import json
import subprocess
import sys

from hybridrl.telemetry.audit import AuditLog, head, records, verify
from tests.launch import ROOT, env_with_repo

WRITER = """
import sys
from hybridrl.telemetry.audit import AuditLog
log = AuditLog(sys.argv[1])
for i in range(50):
    log.append("probe", writer=sys.argv[2], i=i)
"""


def test_appends_from_several_processes_form_one_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w)], cwd=ROOT, env=env_with_repo())
             for w in range(3)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    intact, count, problem = verify(path)
    assert intact and count == 150, problem
    assert [r["n"] for r in records(path)] == list(range(1, 151))
    assert head(path)[0] == 150


def test_the_chain_shows_an_edited_an_inserted_and_a_removed_line(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for i in range(5):
        log.append("egress", destination=f"127.0.0.1:{8000 + i}", verdict="refused: not an allowed destination")
    lines = path.read_text().splitlines()
    assert verify(path) == (True, 5, "")

    edited = json.loads(lines[2])
    edited["verdict"] = "allowed"                  # the same line, its content changed, its hash kept
    path.write_text("\n".join(lines[:2] + [json.dumps(edited, sort_keys=True, separators=(",", ":"))] + lines[3:])
                    + "\n")
    intact, count, problem = verify(path)
    assert not intact and count == 2 and "line 3 was changed" in problem

    path.write_text("\n".join(lines[:2] + lines[3:]) + "\n")      # a line removed
    intact, _, problem = verify(path)
    assert not intact and "line 3 does not follow" in problem

    path.write_text("\n".join(lines[:2] + [lines[4]] + lines[2:]) + "\n")    # a line copied in
    assert not verify(path)[0]

    path.write_text("\n".join(lines) + "\n")       # the original again
    assert verify(path) == (True, 5, "")


def test_the_audit_command_exits_1_on_a_tampered_log(tmp_path, capsys):
    from hybridrl.cli import main

    log = AuditLog(tmp_path / "audit.jsonl")
    log.append("kill_switch_set", reason="x")
    log.append("run_stopped", step=3)
    assert main(["agent", "audit", str(tmp_path)]) == 0
    assert "2 records, chain intact" in capsys.readouterr().out
    text = (tmp_path / "audit.jsonl").read_text().replace('"step":3', '"step":4')
    (tmp_path / "audit.jsonl").write_text(text)
    assert main(["agent", "audit", str(tmp_path)]) == 1
    assert "TAMPERED: line 2 was changed" in capsys.readouterr().out
