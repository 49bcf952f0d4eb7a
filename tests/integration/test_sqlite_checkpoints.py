"""The sqlite store's writes never checkpoint the write-ahead log themselves (its fsyncs took
one write in a few hundred from 0.2 ms to 5 to 15 ms); a thread of the store does, on its own
connection, every `checkpoint_every_s`."""

from __future__ import annotations

import asyncio
import gc
import sqlite3
import threading
import time
from pathlib import Path

from proxy.state.sqlite import SqliteStore

VALUE = b"x" * 4096  # a page or more per record
WRITES = 1_200  # past the 1,000 pages at which a commit would checkpoint by default


def log_frames(path: Path) -> tuple[int, int]:
    """(frames in the log, frames of it already copied into the file), as a reader sees them."""
    with sqlite3.connect(path) as db:
        _, frames, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return frames, copied


def checkpoint_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "loopwarden-sqlite-checkpoints"]


def grown(path: Path, size: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while path.stat().st_size < size:
        assert time.monotonic() < deadline, f"{path} is {path.stat().st_size} bytes, not {size}"
        time.sleep(0.02)


async def write(store: SqliteStore, count: int) -> None:
    for i in range(count):
        await store.put_record("run", f"run_{i}", VALUE, 3600.0)


async def test_writes_leave_the_log_to_the_checkpointer(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path, checkpoint_every_s=3600.0)  # none due during the test
    try:
        await write(store, WRITES)
        size = path.stat().st_size
        # Every write is still in the log: none of them copied it (a default connection's
        # commits would have, at 1,000 pages, and begun the log again).
        assert size < WRITES * len(VALUE) / 10
        frames, _ = await asyncio.to_thread(log_frames, path)  # this checkpoints, as a test
        assert frames > WRITES
        assert len(await store.get_record("run", f"run_{WRITES - 1}") or b"") == len(VALUE)
    finally:
        await store.close()


async def test_the_checkpointer_copies_the_log_into_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path, checkpoint_every_s=0.05)
    try:
        await write(store, 200)
        await asyncio.to_thread(grown, path, 200 * len(VALUE), 5.0)  # the records, in the file
    finally:
        await store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM records").fetchone() == (200,)


async def test_the_checkpoints_end_with_the_store(tmp_path: Path) -> None:
    before = len(checkpoint_threads())
    closed = SqliteStore(tmp_path / "closed.db", checkpoint_every_s=0.05)
    assert len(checkpoint_threads()) == before + 1
    await closed.close()
    assert len(checkpoint_threads()) == before

    dropped = SqliteStore(tmp_path / "dropped.db", checkpoint_every_s=0.05)
    assert len(checkpoint_threads()) == before + 1
    del dropped  # never closed
    gc.collect()
    assert len(checkpoint_threads()) == before


async def test_a_rollback_journal_has_no_log_to_checkpoint(tmp_path: Path) -> None:
    before = len(checkpoint_threads())
    store = SqliteStore(tmp_path / "state.db", journal="rollback")
    try:
        assert len(checkpoint_threads()) == before
        await write(store, 3)
    finally:
        await store.close()
