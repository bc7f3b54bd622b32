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


def test_no_content_can_brick_the_log(tmp_path):
    """The fourth red-team round: an egress target of 11,000 x 0xFF made a 66 KB line and every later
    append raised. Now every line stays under MAX_LINE (fields cut, their length noted), and the
    log goes on and verifies."""
    from hybridrl.telemetry.audit import MAX_LINE

    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.append("egress", destination="\xff" * 11000, verdict="refused")
    log.append("many", **{f"field{i}": "x" * 500 for i in range(200)})        # many fields, each under the cut
    log.append("nested", detail={"a": ["\xff" * 5000] * 40})
    log.append("sandbox_call", episode="other", exit_code=0)
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 4 and max(len(line) for line in lines) <= MAX_LINE
    assert verify(path) == (True, 4, "")
    first = json.loads(lines[0])
    assert first["destination"].startswith("\xff" * 100) and first["destination"].endswith("[11000 chars]")
    assert json.loads(lines[1])["oversize"]["chars"] > MAX_LINE
    assert json.loads(lines[3])["episode"] == "other"


def test_a_log_bricked_before_still_takes_appends_and_fails_verify(tmp_path):
    """A line over the limit already in the log (written by an earlier version): appends go on,
    chained after it, and `verify` names it."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    log.append("probe", i=0)
    big = json.loads(path.read_text())
    big.update(n=2, destination="\\u00ff" * 11000)
    with open(path, "a") as f:
        f.write(json.dumps(big) + "\n")
    log.append("probe", i=1)
    intact, count, problem = verify(path)
    assert not intact and count == 1 and "over the writers' limit" in problem, problem


def test_verify_sees_a_cut_tail_and_writers_go_on_after_it(tmp_path):
    """A log cut inside its last line (even by just its newline) is not intact; a writer that comes
    after the cut starts a new line chained to the last whole record."""
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    for i in range(3):
        log.append("probe", i=i)
    whole = path.read_bytes()
    path.write_bytes(whole[:-1])                     # only the last newline gone
    intact, count, problem = verify(path)
    assert not intact and count == 2 and "line 3 is cut short" in problem, problem
    path.write_bytes(whole[:-40])                    # the last line cut in the middle
    assert not verify(path)[0]
    record = log.append("probe", i=3)
    assert record["n"] == 3                          # chained after record 2, the last whole one
    intact, count, problem = verify(path)
    assert not intact and count == 2 and "line 3 is not JSON" in problem, problem
    assert [r["n"] for r in records(path)] == [1, 2, 3]
    assert head(path)[0] == 3


def test_a_failed_write_is_counted_not_raised(tmp_path, caplog):
    log = AuditLog(tmp_path / "audit.jsonl")
    assert log.record("probe", i=0)
    (tmp_path / "audit.jsonl").unlink()
    (tmp_path / "audit.jsonl").mkdir()              # a write there fails (EISDIR), for root too
    assert not log.record("probe", i=1)
    assert log.failures == 1 and "could not record probe" in caplog.text
