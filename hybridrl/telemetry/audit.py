"""The run's security audit log: append-only JSON lines, each chained to the one before by a hash,
so that editing, inserting or deleting a line anywhere but at the very end shows.

    {"n": 7, "time": 1733.2, "kind": "egress", "pid": 4242, ..., "prev": "<hash of line 6>", "hash": "<sha256>"}

`hash` is sha256 over the previous line's hash and this record's canonical JSON (without `hash`);
the first line's `prev` is 64 zeros. Writers in several processes of one host (every rollout rank's
sandbox pool, the environment service, `hybridrl agent kill-switch`) append under an exclusive
`flock` of the file, each reading the chain's head (the last line) first, so one file holds one
chain. `verify(path)` recomputes it and names the first line that does not match.

What the chain does not show: a log cut short at a line boundary (the chain up to there is
intact). Keep the head hash somewhere else to catch that (`head(path)`; `hybridrl agent audit
RUN_DIR` prints it). A cut inside a line, a line over the writers' limit, or any line that does
not chain, `verify` reports.

No content can brick the log: a record's fields are cut to FIELD_CHARS each (length noted) and its
line to MAX_LINE (`_bounded`), so a tool's egress target of any size makes one short line; a
writer finding a damaged end (a cut-short line) starts a new line after it, chained to the last
whole record, and `verify` names the damage.

Who writes what: the sandbox pool (a pool's start with its isolation, memory limit, syscall filter
and egress policy; every sandbox call; every egress attempt with its verdict and bytes; the kill
switch tripping), the environment service (refusals: bad tokens, conflicts, out-of-order steps,
steps in doubt; lease revocations), and the kill-switch command. Syscalls the filter refuses are
answered with an errno inside the tool and are not observable from outside (no audit daemon is
assumed), so they are not logged one by one; the filter itself (its hash) is.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)

GENESIS = "0" * 64
MAX_LINE = 16384                  # a record's line; longer content is cut (`_bounded`), never refused
FIELD_CHARS = 512                 # a string field longer than this is cut to it, its length noted
_TAIL = 1 << 16                   # how far back a writer looks for the chain's head
_SCAN = 1 << 20                   # ... at most, past damage (a partial or foreign line)
_CORE = ("n", "time", "kind", "host", "pid", "prev")


def configured_path(value: str | None) -> str | None:
    """A log / switch path from a config value: None when empty or when it still holds an
    unresolved `${...}` (a config built outside the loader, which has no run directory)."""
    if not value or "${" in value:
        return None
    return value


def _canonical(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), default=str)


def _digest(prev: str, record: dict[str, Any]) -> str:
    return hashlib.sha256((prev + _canonical(record)).encode()).hexdigest()


def clip(value: Any, limit: int = FIELD_CHARS) -> Any:
    """A string cut to `limit` characters with its length noted; anything else as it is."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}...[{len(value)} chars]"
    return value


def _bounded(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with every string field cut to FIELD_CHARS; if its line is still over MAX_LINE (many
    or nested fields), its own fields are replaced by a summary. Whatever a field holds (a tool
    chose the egress target), the line stays under the limit every writer can chain after."""
    core = {k: record[k] for k in _CORE if k in record}
    fields = {str(k)[:64]: clip(v) for k, v in record.items() if k not in _CORE}
    out = {**fields, **core}
    if len(_canonical(out).encode()) + 100 > MAX_LINE:          # + the hash field
        body = _canonical(fields)
        out = {**core, "oversize": {"chars": len(body), "keys": [k for k in list(fields)[:32]],
                                    "head": body[:1024]}}
    return out


class AuditLog:
    """Append records to one chained log (safe across threads and processes of one host).

    `append` raises only for I/O (a full disk, a missing directory): no content can make a line that
    later appends refuse. Writers inside a run (the sandbox pool, the egress proxy, the environment
    service) call `record`, which never raises: a failed write is logged as an error and counted
    (`failures`), so the audit log can never turn an unrelated episode's call into an error."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._host = socket.gethostname()
        self.failures = 0

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            n, prev, terminated = _head_of(fd)
            record = _bounded({**fields, "n": n + 1, "time": time.time(), "kind": kind, "host": self._host,
                               "pid": os.getpid(), "prev": prev})
            record["hash"] = _digest(prev, record)
            # after a cut-short line: a new line, so that this record is whole (verify reports the damage)
            os.write(fd, ("" if terminated else "\n").encode() + (_canonical(record) + "\n").encode())
            return record
        finally:
            os.close(fd)              # closing drops the lock

    def record(self, kind: str, **fields: Any) -> bool:
        """`append` that never raises: False (logged, counted in `failures`) when the write failed."""
        try:
            self.append(kind, **fields)
            return True
        except Exception as err:  # noqa: BLE001 - the log must not fail the caller's work
            self.failures += 1
            log.error("audit log %s: could not record %s (%d failed so far): %s: %s", self.path, kind,
                      self.failures, type(err).__name__, err)
            return False


def _head_of(fd: int) -> tuple[int, str, bool]:
    """(number, hash) of the last whole record in the open file ((0, GENESIS) when empty) and whether
    the file ends with a newline. Damage at the end (a cut-short or foreign line) is skipped: the
    writer chains after the last good record and `verify` reports the damaged line."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0, GENESIS, True
    terminated = os.pread(fd, 1, size - 1) == b"\n"
    end = size
    while end > 0 and size - end < _SCAN:
        start = max(0, end - _TAIL)
        chunk = os.pread(fd, end - start, start)
        lines = chunk.split(b"\n")
        first = 0 if start == 0 else 1                           # lines[0] may begin before `start`
        for line in reversed(lines[first:]):
            found = _parse_head(line)
            if found is not None:
                return found[0], found[1], terminated
        end = start + len(lines[0]) if start > 0 else 0
        if start > 0 and end >= start + len(chunk):               # one line longer than the window
            end = start
    return 0, GENESIS, terminated


def _parse_head(line: bytes) -> tuple[int, str] | None:
    try:
        record = json.loads(line)
        return int(record["n"]), str(record["hash"])
    except (ValueError, TypeError, KeyError):
        return None


def records(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The log's records (lines that are not a JSON object are skipped: `verify` names them)."""
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def verify(path: str | os.PathLike) -> tuple[bool, int, str]:
    """(intact, records checked, what is wrong). Intact means every line is whole (ends with a
    newline, within MAX_LINE, a JSON object), its hash matches its content and the line before it,
    and the numbers run 1, 2, 3, ... A log cut at a line boundary still verifies: keep the head."""
    prev, n = GENESIS, 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                return False, n, f"line {lineno} is cut short (no newline at its end): the log was truncated"
            if not line.strip():
                continue
            if len(line) > MAX_LINE + 1:
                return False, n, f"line {lineno} is {len(line)} bytes, over the writers' limit of {MAX_LINE}"
            try:
                record = json.loads(line)
            except ValueError:
                return False, n, f"line {lineno} is not JSON"
            if not isinstance(record, dict):
                return False, n, f"line {lineno} is not a JSON object"
            claimed = record.pop("hash", None)
            if record.get("prev") != prev:
                return False, n, f"line {lineno} does not follow line {lineno - 1} (its prev hash differs)"
            if claimed != _digest(prev, record):
                return False, n, f"line {lineno} was changed after it was written (hash mismatch)"
            if record.get("n") != n + 1:
                return False, n, f"line {lineno} is record {record.get('n')}, expected {n + 1}"
            prev, n = claimed, n + 1
    return True, n, ""


def head(path: str | os.PathLike) -> tuple[int, str]:
    """The chain's head: (records, hash of the last whole one)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _head_of(fd)[:2]
    finally:
        os.close(fd)


def open_log(value: str | None) -> AuditLog | None:
    path = configured_path(value)
    return AuditLog(path) if path else None
