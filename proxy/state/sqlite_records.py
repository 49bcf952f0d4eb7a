"""Records (stored responses, run reports, held calls) in a sqlite file: the statements the
sqlite store runs on its connection's thread. Puts are written together (group commit: `write`,
one statement for the records of several puts); every record is found by its primary key."""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from proxy.state import sqlite_threads as threads
from proxy.state.store import RECORDS_AT_ONCE, Record, first_within

ROWS_PER_WRITE = 200  # records in one statement: 4 parameters each, within sqlite's 999
TABLES = [
    """CREATE TABLE IF NOT EXISTS records (
        kind TEXT NOT NULL,
        key TEXT NOT NULL,
        value BLOB NOT NULL,
        expires_at REAL NOT NULL,
        PRIMARY KEY (kind, key)
    )""",
    # The sweep finds expired rows without reading the others (Responses are kept for days).
    "CREATE INDEX IF NOT EXISTS records_by_expiry ON records (expires_at)",
]
SWEEP = "DELETE FROM records WHERE expires_at <= ?"


class Write(NamedTuple):
    """One put: its records, kept `ttl_s`, and the thread and records it keeps as long."""

    records: Sequence[Record]
    ttl_s: float
    thread: str | None
    kept: Sequence[tuple[str, str]]


def write(writes: list[Write], db: sqlite3.Connection) -> list[int]:
    """The writes' records in one statement, after the threads and records they keep; the
    records kept for as long are kept together (most writes keep theirs as long). Gives how
    many of the records each write keeps were there."""
    # Deadlines are wall-clock times: other processes and later runs read them.
    now = time.time()
    kept: dict[float, dict[tuple[str, str], None]] = {}  # by end, each pair once
    for put in writes:
        if put.thread is not None:
            threads.keep(db, put.thread, now + put.ttl_s)
        if put.kept:
            kept.setdefault(now + put.ttl_s, {}).update(dict.fromkeys(put.kept))
    found = asked = 0
    for end, pairs in kept.items():
        flat = [part for pair in pairs for part in pair]
        asked += len(pairs)
        for at in range(0, len(flat), 2 * RECORDS_AT_ONCE):
            chunk = flat[at : at + 2 * RECORDS_AT_ONCE]
            found += db.execute(keep_pairs(len(chunk) // 2), [end, now, *chunk]).rowcount
    counts = [len(put.kept) for put in writes]
    if found != asked:  # one was not there: count each write's
        counts = [len(_read(db, put.kept, "1")) if put.kept else 0 for put in writes]
    rows = [(*record, now + put.ttl_s) for put in writes for record in put.records]
    if rows:
        db.execute(_insert(len(rows)), [value for row in rows for value in row])
    return counts


def get(db: sqlite3.Connection, kind: str, key: str) -> bytes | None:
    row = db.execute(
        "SELECT value FROM records WHERE kind = ? AND key = ? AND expires_at > ?",
        (kind, key, time.time()),
    ).fetchone()
    return None if row is None else bytes(row[0])


def get_many(
    db: sqlite3.Connection, wanted: Sequence[tuple[str, str]], max_bytes: int | None
) -> list[bytes | None]:
    """`StateStore.get_records`: with `max_bytes`, the sizes first (what is not read is not
    held)."""
    asked = wanted
    if max_bytes is not None:
        sizes = _read(db, wanted, "length(r.value)")
        asked = wanted[: first_within([sizes.get(pair, 0) for pair in wanted], max_bytes)]
    found = _read(db, asked, "r.value")
    return [None if (value := found.get(pair)) is None else bytes(value) for pair in asked]


def delete(db: sqlite3.Connection, pairs: Sequence[tuple[str, str]]) -> int:
    """Drops the live records of `pairs`, each found by its primary key; how many there were.
    An expired row is left to the sweep: it reads as absent already."""
    parameters = (time.time(), *(part for pair in pairs for part in pair))
    return db.execute(delete_pairs(len(pairs)), parameters).rowcount


@functools.lru_cache(maxsize=RECORDS_AT_ONCE)
def delete_pairs(pairs: int) -> str:
    """One statement that drops the live records of `pairs` (kind, key) pairs, each found by
    its primary key (sqlite looks each term of the OR up)."""
    return f"DELETE FROM records WHERE expires_at > ? AND ({_by_key(pairs)})"


def _read(
    db: sqlite3.Connection, pairs: Sequence[tuple[str, str]], what: str
) -> dict[tuple[str, str], Any]:
    parameters = (*(part for pair in pairs for part in pair), time.time())
    rows = db.execute(read_pairs(what, len(pairs)), parameters)
    return {(kind, key): value for kind, key, value in rows}


@functools.lru_cache(maxsize=ROWS_PER_WRITE)
def _insert(rows: int) -> str:
    """One statement that writes `rows` records (a later one of a key replaces an earlier)."""
    values = ", ".join(["(?, ?, ?, ?)"] * rows)
    return (
        f"INSERT INTO records (kind, key, value, expires_at) VALUES {values} "
        "ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value, "
        "expires_at = excluded.expires_at"
    )


@functools.lru_cache(maxsize=RECORDS_AT_ONCE)
def keep_pairs(pairs: int) -> str:
    """One statement that gives the live records of `pairs` (kind, key) pairs a new end, each
    found by its primary key (sqlite looks each term of the OR up)."""
    return f"UPDATE records SET expires_at = ? WHERE expires_at > ? AND ({_by_key(pairs)})"


def _by_key(pairs: int) -> str:
    """The records of `pairs` (kind, key) pairs, each term found by the primary key."""
    return " OR ".join(["(kind = ? AND key = ?)"] * pairs)


@functools.lru_cache(maxsize=2 * RECORDS_AT_ONCE)
def read_pairs(what: str, pairs: int) -> str:
    """Reads `what` of the records of `pairs` (kind, key) pairs, each found by its primary key
    (`(kind, key) IN (...)` has sqlite scan the expiry index instead: every live record)."""
    values = ", ".join(["(?, ?)"] * pairs)
    return (
        f"SELECT r.kind, r.key, {what} FROM (VALUES {values}) AS w "
        "JOIN records AS r ON r.kind = w.column1 AND r.key = w.column2 WHERE r.expires_at > ?"
    )
