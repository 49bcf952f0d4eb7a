"""Stored contexts (SPEC §10) in a sqlite file: the statements the sqlite store runs on its
connection's thread. A context is saved by compare-and-set on its version; the runs on one are
serialised by a lock row with a random token and a lease (wall-clock, shared by processes)."""

from __future__ import annotations

import sqlite3
import time

from proxy.state.store import StoredContext

TABLES = [
    """CREATE TABLE IF NOT EXISTS contexts (
        id TEXT PRIMARY KEY,
        body BLOB NOT NULL,
        updated REAL,
        version INTEGER NOT NULL DEFAULT 1
    )""",
    # Contexts that end (state.context_ttl_s) are swept by when they were last saved.
    "CREATE INDEX IF NOT EXISTS contexts_by_update ON contexts (updated)",
    # Who holds each context (a random token) and until when (wall-clock, shared).
    """CREATE TABLE IF NOT EXISTS context_locks (
        id TEXT PRIMARY KEY,
        token TEXT NOT NULL,
        expires_at REAL NOT NULL
    )""",
]
SWEEP = "DELETE FROM contexts WHERE updated <= ?"


def add_versions(db: sqlite3.Connection) -> None:
    """Adds what a file from before contexts had versions lacks."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(contexts)")}
    if "version" not in columns:
        db.execute("ALTER TABLE contexts ADD COLUMN version INTEGER NOT NULL DEFAULT 1")


def read(db: sqlite3.Connection, context_id: str, ended: float) -> StoredContext | None:
    """The context, unless it was last saved before `ended`."""
    row = db.execute(
        "SELECT body, version FROM contexts WHERE id = ? AND (updated IS NULL OR updated > ?)",
        (context_id, ended),
    ).fetchone()
    if row is None:
        return None
    context = StoredContext.loads(row[0])
    context.version = row[1]
    return context


def save(
    db: sqlite3.Connection,
    context: StoredContext,
    body: bytes,
    version: int,
    ended: float,
    held: bool,
) -> bool:
    """Stores `context` as `version` (its stored form `body`) when the stored copy is still the
    one it was read from: none, or one last saved before `ended`, for a new one. A `held`
    context that ended and was swept meanwhile is that one: no one else could change it."""
    if context.version == 0:
        saved = db.execute(
            "INSERT INTO contexts (id, body, updated, version) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET body = excluded.body, "
            "updated = excluded.updated, version = excluded.version "
            "WHERE contexts.updated <= ?",
            (context.id, body, time.time(), version, ended),
        )
    elif held:
        saved = db.execute(
            "INSERT INTO contexts (id, body, updated, version) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET body = excluded.body, "
            "updated = excluded.updated, version = excluded.version "
            "WHERE contexts.version = ?",
            (context.id, body, time.time(), version, context.version),
        )
    else:
        saved = db.execute(
            "UPDATE contexts SET body = ?, updated = ?, version = ? WHERE id = ? AND version = ?",
            (body, time.time(), version, context.id, context.version),
        )
    return saved.rowcount == 1


def delete(db: sqlite3.Connection, context_id: str, ended: float) -> bool:
    """Drops the context; whether there was one (that had not ended)."""
    found = read(db, context_id, ended) is not None
    db.execute("DELETE FROM contexts WHERE id = ?", (context_id,))
    return found


def take(db: sqlite3.Connection, context_id: str, token: str, lease_s: float) -> bool:
    """Takes the context's lock row for `token`, when it is free or its lease is over."""
    now = time.time()
    taken = db.execute(
        "INSERT INTO context_locks (id, token, expires_at) VALUES (?, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET token = excluded.token, "
        "expires_at = excluded.expires_at WHERE context_locks.expires_at <= ?",
        (context_id, token, now + lease_s, now),
    )
    return taken.rowcount == 1


def renew(db: sqlite3.Connection, context_id: str, token: str, lease_s: float) -> bool:
    """Extends the lease of `token`'s hold; False when it holds it no more."""
    renewed = db.execute(
        "UPDATE context_locks SET expires_at = ? WHERE id = ? AND token = ?",
        (time.time() + lease_s, context_id, token),
    )
    return renewed.rowcount == 1


def holder(db: sqlite3.Connection, context_id: str) -> str | None:
    """The token of the context's lock row; None when there is none. A row goes only with its
    holder's `let_go`: a token that finds none was taken over (its lease lost) and let go."""
    row = db.execute("SELECT token FROM context_locks WHERE id = ?", (context_id,)).fetchone()
    return None if row is None else str(row[0])


def let_go(db: sqlite3.Connection, context_id: str, token: str) -> None:
    db.execute("DELETE FROM context_locks WHERE id = ? AND token = ?", (context_id, token))
