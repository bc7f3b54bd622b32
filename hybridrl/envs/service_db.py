"""The environment service's database: its tables, and opening the file (write-ahead log, durability).

Every process of a run opens the same SQLite file (`env.db_path`); the service (service.py) does all its
reads and writes through one connection made here. The schema carries a version (`PRAGMA user_version`):
a file written by an older layout is refused with what to do, never migrated in place.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Callable, ContextManager

from hybridrl.envs.service_types import EnvServiceError

SCHEMA_VERSION = 2
SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (
    episode_id TEXT PRIMARY KEY,
    episode_key TEXT UNIQUE,
    task TEXT NOT NULL,
    instance TEXT NOT NULL,
    seed INTEGER NOT NULL,
    token_hash TEXT NOT NULL,
    lease_expires REAL NOT NULL,
    status TEXT NOT NULL,
    last_seq INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL,
    observation TEXT,
    error TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS episodes_by_lease ON episodes (status, lease_expires);
CREATE TABLE IF NOT EXISTS transitions (
    episode_id TEXT NOT NULL,
    seq_no INTEGER NOT NULL,
    idempotency_key TEXT NOT NULL,
    action TEXT NOT NULL,
    phase TEXT NOT NULL,              -- pending | committed | failed
    owner TEXT NOT NULL,              -- the service process that claimed it (host:pid:start:nonce)
    result TEXT,                      -- committed: the transition
    error TEXT,                       -- failed: why
    created REAL NOT NULL,
    PRIMARY KEY (episode_id, seq_no),
    UNIQUE (episode_id, idempotency_key)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    episode_id TEXT,
    kind TEXT NOT NULL,
    detail TEXT
);
"""


def open_database(path: Path, *, synchronous: str, busy_timeout_s: float) -> sqlite3.Connection:
    """A connection to the service's file in WAL mode (autocommit: the service opens its own transactions),
    waiting up to `busy_timeout_s` for another process's write lock."""
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=busy_timeout_s)
    enter_wal(db, busy_timeout_s)
    db.execute(f"PRAGMA synchronous={synchronous.upper()}")
    return db


def ensure_schema(db: sqlite3.Connection, path: Path, transaction: Callable[[], ContextManager]) -> None:
    """The service's tables in `db`, made inside `transaction()` (the service's write lock) unless another
    process made them already; a file of another schema version is refused."""
    if schema_of(db) == (SCHEMA_VERSION, 1):
        return          # another process made it: a read, so no wait for the write lock its episodes hold
    with transaction():
        version, has_tables = schema_of(db)
        if has_tables and version != SCHEMA_VERSION:
            raise EnvServiceError(f"{path} was written by an older hybridrl (schema {version}, this "
                                  f"one needs {SCHEMA_VERSION}); move it aside or set env.db_path elsewhere")
        for statement in SCHEMA.split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def schema_of(db: sqlite3.Connection) -> tuple[int, int]:
    """(the database's schema version, whether it has the episodes table)."""
    return (db.execute("PRAGMA user_version").fetchone()[0],
            db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'episodes'").fetchone()[0])


def enter_wal(db: sqlite3.Connection, timeout_s: float) -> None:
    """Put the database in write-ahead-log mode (it stays so, in the file). Every rank opens the service at
    start: switching a new file to WAL takes an exclusive lock, and SQLite answers "database is locked" at
    once, without waiting out the busy timeout, when two connections would otherwise deadlock on that
    upgrade; so a file already in WAL is left alone and a refused switch is tried again until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
