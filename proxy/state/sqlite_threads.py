"""Thread counters (SPEC §9) in a sqlite file: the statements the sqlite store runs on its
connection's thread. A thread reserved or kept with a TTL has a row in `thread_ends`: its
counters are not counted once it passed, are dropped at its next reservation, and are swept
with the expired records."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping

TABLES = [
    """CREATE TABLE IF NOT EXISTS thread_calls (
        thread_id TEXT NOT NULL,
        key TEXT NOT NULL,
        count INTEGER NOT NULL,
        PRIMARY KEY (thread_id, key)
    )""",
    # When the counters of a thread reserved with a TTL end (wall-clock, shared).
    """CREATE TABLE IF NOT EXISTS thread_ends (
        thread_id TEXT PRIMARY KEY,
        ends_at REAL NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS thread_ends_by_time ON thread_ends (ends_at)",
]
SWEEP = (
    "DELETE FROM thread_calls WHERE thread_id IN "
    "(SELECT thread_id FROM thread_ends WHERE ends_at <= ?)",
    "DELETE FROM thread_ends WHERE ends_at <= ?",
)
_DROP_ENDED = (
    "DELETE FROM thread_calls WHERE thread_id = ? AND EXISTS "
    "(SELECT 1 FROM thread_ends WHERE thread_id = ? AND ends_at <= ?)"
)
_LIVE = "NOT EXISTS (SELECT 1 FROM thread_ends WHERE thread_id = ? AND ends_at <= ?)"
_END_AT = (
    "INSERT INTO thread_ends (thread_id, ends_at) VALUES (?, ?) "
    "ON CONFLICT (thread_id) DO UPDATE SET ends_at = excluded.ends_at"
)


def reserve(
    db: sqlite3.Connection, thread_id: str, limits: Mapping[str, int], ends_at: float | None
) -> tuple[bool, dict[str, int]]:
    keys = list(limits)
    if ends_at is not None:
        db.execute(_DROP_ENDED, (thread_id, thread_id, time.time()))
        db.execute(_END_AT, (thread_id, ends_at))
    # One statement, so sqlite holds the write lock inside one call (see the store's
    # `_write_puts`); it reads the counts before it writes any, so it adds to all or to none.
    wanted = ", ".join(["(?, ?)"] * len(keys))
    db.execute(
        f"WITH wanted (key, cap) AS (VALUES {wanted}) "
        "INSERT INTO thread_calls (thread_id, key, count) "
        "SELECT ?, key, 1 FROM wanted WHERE NOT EXISTS ("
        "SELECT 1 FROM wanted w LEFT JOIN thread_calls t ON t.thread_id = ? AND t.key = w.key "
        "WHERE COALESCE(t.count, 0) >= w.cap) "
        "ON CONFLICT (thread_id, key) DO UPDATE SET count = count + 1",
        [*(v for key in keys for v in (key, limits[key])), thread_id, thread_id],
    )
    (added,) = db.execute("SELECT changes()").fetchone()  # rowcount misses WITH
    marks = ", ".join("?" for _ in keys)
    rows = db.execute(
        f"SELECT key, count FROM thread_calls WHERE thread_id = ? AND key IN ({marks})",
        (thread_id, *keys),
    )
    found = {key: count for key, count in rows}
    return added == len(keys), {key: found.get(key, 0) for key in keys}


def release(db: sqlite3.Connection, thread_id: str, counts: Mapping[str, int]) -> None:
    db.executemany(
        "UPDATE thread_calls SET count = MAX(count - ?, 0) WHERE thread_id = ? AND key = ?",
        [(n, thread_id, key) for key, n in counts.items()],
    )


def keep(db: sqlite3.Connection, thread_id: str, ends_at: float) -> None:
    # Most chains count nothing: a read finds that without taking the write lock. A thread
    # whose end passed is not kept again (its counters are not counted).
    found = db.execute(
        f"SELECT 1 FROM thread_calls WHERE thread_id = ? AND {_LIVE} LIMIT 1",
        (thread_id, thread_id, time.time()),
    ).fetchone()
    if found is not None:
        db.execute(_END_AT, (thread_id, ends_at))


def counts(db: sqlite3.Connection, thread_id: str) -> dict[str, int]:
    rows = db.execute(
        f"SELECT key, count FROM thread_calls WHERE thread_id = ? AND {_LIVE}",
        (thread_id, thread_id, time.time()),
    )
    return {key: count for key, count in rows}
