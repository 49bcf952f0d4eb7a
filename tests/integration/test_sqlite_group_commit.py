"""The sqlite store writes the records put meanwhile in one transaction (group commit): every
put returns once its record is committed, fails with its batch, and a cancelled put leaves the
others alone."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from proxy.errors import StateUnavailable
from proxy.state.sqlite import SqliteStore

PUTS = 64


def wal_frames(path: Path) -> int:
    """The frames in the file's write-ahead log: each commit writes one at least."""
    with sqlite3.connect(path) as db:
        _, frames, _ = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return int(frames)


def remove(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


async def test_records_put_at_once_are_committed_together(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    try:
        await store.put_record("run", "warm-up", b"{}", 60)  # the schema's pages, once
        frames = wal_frames(path)
        values = [f'{{"n": {i}}}'.encode() for i in range(PUTS)]
        await asyncio.gather(
            *(store.put_record("run", f"r{i}", value, 60) for i, value in enumerate(values))
        )
        # Every put returned with its record committed: a connection of its own reads them.
        with sqlite3.connect(path) as db:
            rows = dict(db.execute("SELECT key, value FROM records WHERE key LIKE 'r%'"))
        assert rows == {f"r{i}": value for i, value in enumerate(values)}
        assert wal_frames(path) - frames < PUTS  # fewer commits than puts
    finally:
        await store.close()


async def test_puts_of_one_key_keep_their_order(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    try:
        await asyncio.gather(*(store.put_record("run", "same", b"%d" % i, 60) for i in range(20)))
        assert await store.get_record("run", "same") == b"19"
    finally:
        await store.close()


async def test_every_put_of_a_failed_batch_fails_and_none_hangs(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    try:
        await store.put_record("run", "before", b"{}", 60)
        remove(path)
        results = await asyncio.wait_for(
            asyncio.gather(
                *(store.put_record("run", f"r{i}", b"{}", 60) for i in range(10)),
                return_exceptions=True,
            ),
            timeout=10,
        )
        assert all(isinstance(r, StateUnavailable) for r in results), results
        assert len({id(r) for r in results}) == 10  # each its own error, not one shared
        assert "deleted or replaced" in str(results[0])
    finally:
        await store.close()


async def test_a_cancelled_put_leaves_its_batch_alone(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    try:
        puts = [asyncio.create_task(store.put_record("run", f"r{i}", b"{}", 60)) for i in range(8)]
        await asyncio.sleep(0)  # every put has joined the batch
        puts[3].cancel()
        results = await asyncio.gather(*puts, return_exceptions=True)
        assert isinstance(results[3], asyncio.CancelledError)
        assert [r for i, r in enumerate(results) if i != 3] == [None] * 7
        assert await store.get_record("run", "r7") == b"{}"
    finally:
        await store.close()


async def test_a_put_on_a_closed_store_fails_at_once(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    await store.close()
    with pytest.raises(StateUnavailable, match="closed database"):
        await asyncio.wait_for(store.put_record("run", "late", b"{}", 60), timeout=5)
