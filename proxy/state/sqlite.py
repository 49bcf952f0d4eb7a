"""State in one SQLite file: survives restarts; thread counts stay exact between processes
that share the file (each reservation is one IMMEDIATE transaction)."""

from __future__ import annotations

import asyncio
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TypeVar

from proxy.state.locks import KeyedLocks
from proxy.state.store import StoredContext, check_ttl

T = TypeVar("T")
SWEEP_EVERY_S = 60.0  # the most often expired records are deleted

_SCHEMA = """
CREATE TABLE IF NOT EXISTS thread_calls (
    thread_id TEXT NOT NULL,
    key TEXT NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (thread_id, key)
);
CREATE TABLE IF NOT EXISTS contexts (id TEXT PRIMARY KEY, body BLOB NOT NULL, updated REAL);
CREATE TABLE IF NOT EXISTS records (
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    expires_at REAL NOT NULL,
    PRIMARY KEY (kind, key)
);
-- The sweep finds expired rows without reading the others (Responses are kept for days).
CREATE INDEX IF NOT EXISTS records_by_expiry ON records (expires_at);
"""


class SqliteStore:
    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._mutex = threading.Lock()
        self._swept = -math.inf  # monotonic; the first put sweeps what expired before it
        self._locks = KeyedLocks()

    async def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        def locked() -> T:
            with self._mutex:
                return work(self._db)

        return await asyncio.to_thread(locked)

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int]
    ) -> tuple[bool, dict[str, int]]:
        keys = list(limits)

        def work(db: sqlite3.Connection) -> tuple[bool, dict[str, int]]:
            db.execute("BEGIN IMMEDIATE")
            try:
                counts = _counts(db, thread_id, keys)
                if any(counts[key] >= limits[key] for key in keys):
                    db.execute("ROLLBACK")
                    return False, counts
                db.executemany(
                    "INSERT INTO thread_calls (thread_id, key, count) VALUES (?, ?, 1) "
                    "ON CONFLICT (thread_id, key) DO UPDATE SET count = count + 1",
                    [(thread_id, key) for key in keys],
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            return True, {key: counts[key] + 1 for key in keys}

        return await self._call(work)

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        def work(db: sqlite3.Connection) -> dict[str, int]:
            rows = db.execute(
                "SELECT key, count FROM thread_calls WHERE thread_id = ?", (thread_id,)
            )
            return {key: count for key, count in rows}

        return await self._call(work)

    async def load_context(self, context_id: str) -> StoredContext | None:
        def work(db: sqlite3.Connection) -> StoredContext | None:
            row = db.execute("SELECT body FROM contexts WHERE id = ?", (context_id,)).fetchone()
            return None if row is None else StoredContext.loads(row[0])

        return await self._call(work)

    async def save_context(self, context: StoredContext) -> None:
        body = context.dumps()

        def work(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO contexts (id, body, updated) VALUES (?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET body = excluded.body, updated = excluded.updated",
                (context.id, body, time.time()),
            )

        await self._call(work)

    async def delete_context(self, context_id: str) -> bool:
        def work(db: sqlite3.Connection) -> bool:
            return bool(db.execute("DELETE FROM contexts WHERE id = ?", (context_id,)).rowcount)

        return await self._call(work)

    async def put_record(self, kind: str, key: str, value: bytes, ttl_s: float) -> None:
        # Deadlines are wall-clock times: other processes and later runs read them.
        now = time.time()
        expires_at = now + check_ttl(ttl_s)
        clock = time.monotonic()
        sweep = clock - self._swept >= SWEEP_EVERY_S
        if sweep:
            self._swept = clock

        def work(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO records (kind, key, value, expires_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value, "
                "expires_at = excluded.expires_at",
                (kind, key, value, expires_at),
            )
            if sweep:  # expired rows do not pile up
                db.execute("DELETE FROM records WHERE expires_at <= ?", (now,))

        await self._call(work)

    async def get_record(self, kind: str, key: str) -> bytes | None:
        def work(db: sqlite3.Connection) -> bytes | None:
            row = db.execute(
                "SELECT value FROM records WHERE kind = ? AND key = ? AND expires_at > ?",
                (kind, key, time.time()),
            ).fetchone()
            return None if row is None else bytes(row[0])

        return await self._call(work)

    async def delete_record(self, kind: str, key: str) -> bool:
        def work(db: sqlite3.Connection) -> bool:
            # An expired row is left to the sweep: it reads as absent already.
            deleted = db.execute(
                "DELETE FROM records WHERE kind = ? AND key = ? AND expires_at > ?",
                (kind, key, time.time()),
            )
            return bool(deleted.rowcount)

        return await self._call(work)

    def hold(self, context_id: str) -> AbstractAsyncContextManager[None]:
        return self._locks.hold(context_id)

    async def ping(self) -> None:
        await self._call(lambda db: db.execute("SELECT 1").fetchone())

    async def close(self) -> None:
        await self._call(lambda db: db.close())


def _counts(db: sqlite3.Connection, thread_id: str, keys: list[str]) -> dict[str, int]:
    marks = ", ".join("?" for _ in keys)
    rows = db.execute(
        f"SELECT key, count FROM thread_calls WHERE thread_id = ? AND key IN ({marks})",
        (thread_id, *keys),
    )
    found = {key: count for key, count in rows}
    return {key: found.get(key, 0) for key in keys}
