"""The run's security audit log: append-only JSON lines, each chained to the one before by a hash,
so that editing, inserting or deleting a line anywhere but at the very end shows.

    {"n": 7, "time": 1733.2, "kind": "egress", "pid": 4242, ..., "prev": "<hash of line 6>", "hash": "<sha256>"}

`hash` is sha256 over the previous line's hash and this record's canonical JSON (without `hash`);
the first line's `prev` is 64 zeros. Writers in several processes of one host (every rollout rank's
sandbox pool, the environment service, `hybridrl agent kill-switch`) append under an exclusive
`flock` of the file, each reading the chain's head (the last line) first, so one file holds one
chain. `verify(path)` recomputes it and names the first line that does not match.

What the chain does not show: a log cut short at its end (the chain up to there is intact). Keep
the head hash somewhere else to catch that (`head(path)`; `hybridrl agent audit RUN_DIR` prints it).

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
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

GENESIS = "0" * 64
_TAIL = 1 << 16

def configured_path(value: str | None) -> str | None:
    """A log / switch path from a config value: None when empty or when it still holds an
    unresolved `${...}` (a config built outside the loader, which has no run directory)."""
    if not value or "${" in value:
        return None
    return value


def _digest(prev: str, record: dict[str, Any]) -> str:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256((prev + body).encode()).hexdigest()


class AuditLog:
    """Append records to one chained log (safe across threads and processes of one host)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._host = socket.gethostname()

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            n, prev = _head_of(fd)
            record = {"n": n + 1, "time": time.time(), "kind": kind, "host": self._host, "pid": os.getpid(),
                      **fields, "prev": prev}
            record["hash"] = _digest(prev, record)
            os.write(fd, (json.dumps(record, sort_keys=True, separators=(",", ":"), default=str) + "\n").encode())
            return record
        finally:
            os.close(fd)              # closing drops the lock


def _head_of(fd: int) -> tuple[int, str]:
    """(number, hash) of the last record in the open file; (0, GENESIS) when empty."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0, GENESIS
    start = max(0, size - _TAIL)
    tail = os.pread(fd, size - start, start)
    lines = tail.rstrip(b"\n").split(b"\n")
    if start > 0 and len(lines) < 2:
        raise ValueError(f"audit log line longer than {_TAIL} bytes")
    last = json.loads(lines[-1])
    return int(last["n"]), str(last["hash"])


def records(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    with open(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def verify(path: str | os.PathLike) -> tuple[bool, int, str]:
    """(intact, records checked, what is wrong). Intact means every line's hash matches its content
    and the line before it, and the numbers run 1, 2, 3, ..."""
    prev, n = GENESIS, 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                return False, n, f"line {lineno} is not JSON"
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
    """The chain's head: (records, hash of the last one)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _head_of(fd)
    finally:
        os.close(fd)


def open_log(value: str | None) -> AuditLog | None:
    path = configured_path(value)
    return AuditLog(path) if path else None
