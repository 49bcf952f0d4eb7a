"""Records put meanwhile are written together (group commit): in one sqlite transaction, in
one redis call (a script). Every put returns once its record is written, fails with its batch (an
error of its own), keeps its order among puts of one key, and may be cancelled alone."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from proxy.errors import StateUnavailable
from proxy.state.redis import RedisStore
from proxy.state.sqlite import SqliteStore
from proxy.state.store import Record, StateStore, batches
from tests.records import put_record
from tests.servers import redis_server

PUTS = 64


@pytest.fixture(params=["sqlite", "redis"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, redis_url: str
) -> AsyncIterator[StateStore]:
    if request.param == "sqlite":
        opened: StateStore = SqliteStore(tmp_path / "state.db")
    else:
        opened = RedisStore(redis_url, prefix=f"batch-{secrets.token_hex(4)}:")
    yield opened
    await opened.close()


async def put_many(store: StateStore, values: list[bytes], key: str = "r{}") -> None:
    await asyncio.gather(
        *(put_record(store, "run", key.format(i), value, 60) for i, value in enumerate(values))
    )


async def test_records_put_at_once_are_all_written(store: StateStore) -> None:
    values = [b'{"n": %d}' % i for i in range(PUTS)]
    await put_many(store, values)
    assert [await store.get_record("run", f"r{i}") for i in range(PUTS)] == values


async def test_puts_of_one_key_keep_their_order(store: StateStore) -> None:
    await put_many(store, [b"%d" % i for i in range(20)], key="same")
    assert await store.get_record("run", "same") == b"19"


async def test_records_kept_by_puts_at_once_are_each_kept_as_long(store: StateStore) -> None:
    """Each put's own TTL, whether kept together (sqlite: one statement for those kept as long)
    or not; a short one does not shorten another's."""
    await store.put_records([Record("part", f"p{i}", b"%d" % i) for i in range(PUTS)], 0.2)
    ttls = [0.3 if i % 3 == 0 else 30 for i in range(PUTS)]
    await asyncio.gather(
        *(
            store.put_records([Record("tail", f"t{i}", b"")], ttl, keep=[("part", f"p{i}")])
            for i, ttl in enumerate(ttls)
        )
    )
    await asyncio.sleep(0.5)
    found = await store.get_records([("part", f"p{i}") for i in range(PUTS)])
    assert found == [None if ttl < 1 else b"%d" % i for i, ttl in enumerate(ttls)]


async def test_puts_at_once_each_say_how_many_of_the_records_they_keep_were_there(
    store: StateStore,
) -> None:
    """Each its own count, though they went in one write (sqlite: one statement for the records
    kept as long, which finds one kept by every put once)."""
    await store.put_records([Record("part", f"p{i}", b"") for i in range(0, PUTS, 2)], 30)
    await put_record(store, "part", "shared", b"", 30)
    found = await asyncio.gather(
        *(
            store.put_records(
                [Record("tail", f"t{i}", b"")], 30, keep=[("part", f"p{i}"), ("part", "shared")]
            )
            for i in range(PUTS)
        )
    )
    assert found == [2 if i % 2 == 0 else 1 for i in range(PUTS)]
    alone = await asyncio.gather(
        *(store.put_records([], 30, keep=[("part", f"p{i}")]) for i in range(PUTS))
    )
    assert alone == [1 if i % 2 == 0 else 0 for i in range(PUTS)]


async def test_a_cancelled_put_leaves_its_batch_alone(store: StateStore) -> None:
    puts = [asyncio.create_task(put_record(store, "run", f"r{i}", b"{}", 60)) for i in range(8)]
    await asyncio.sleep(0)  # every put has joined a batch
    puts[3].cancel()
    results = await asyncio.gather(*puts, return_exceptions=True)
    assert isinstance(results[3], asyncio.CancelledError)
    assert [r for i, r in enumerate(results) if i != 3] == [None] * 7
    assert await store.get_record("run", "r7") == b"{}"
    await put_record(store, "run", "after", b"{}", 60)  # the way is free again
    assert await store.get_record("run", "after") == b"{}"


def wal_frames(path: Path) -> int:
    """The frames in the file's write-ahead log: each commit writes one at least."""
    with sqlite3.connect(path) as db:
        _, frames, _ = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return int(frames)


async def test_sqlite_commits_records_put_at_once_together(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    try:
        await put_record(store, "run", "warm-up", b"{}", 60)  # the schema's pages, once
        frames = wal_frames(path)
        await put_many(store, [b"{}"] * PUTS)
        # Every put returned with its record committed: a connection of its own reads them.
        with sqlite3.connect(path) as db:
            (count,) = db.execute("SELECT count(*) FROM records WHERE key LIKE 'r%'").fetchone()
        assert count == PUTS
        assert wal_frames(path) - frames < PUTS  # fewer commits than puts
    finally:
        await store.close()


def connections(url: str) -> int:
    with redis.Redis.from_url(url) as admin:
        return len(admin.client_list()) - 1  # without this one


async def test_redis_sends_records_put_at_once_on_few_connections(redis_url: str) -> None:
    store = RedisStore(redis_url, prefix=f"batch-{secrets.token_hex(4)}:")
    before = connections(redis_url)
    try:
        await put_many(store, [b"{}"] * PUTS)
        # One call at once, the rest in one call after it: two connections at most
        # (a command a connection would have opened one for each put).
        assert connections(redis_url) - before <= 2
        assert await store.get_record("run", f"r{PUTS - 1}") == b"{}"
    finally:
        await store.close()


def remove(path: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_every_put_of_a_failed_batch_fails_and_none_hangs(kind: str, tmp_path: Path) -> None:
    server = redis_server(tmp_path / "redis") if kind == "redis" else None
    if server is not None:
        (tmp_path / "redis").mkdir()
        store: StateStore = RedisStore(server.__enter__(), timeout_s=2)
    else:
        store = SqliteStore(tmp_path / "state.db")
    try:
        await put_record(store, "run", "before", b"{}", 60)
        if server is not None:
            server.__exit__(None, None, None)
        else:
            remove(tmp_path / "state.db")
        results = await asyncio.wait_for(
            asyncio.gather(
                *(put_record(store, "run", f"r{i}", b"{}", 60) for i in range(10)),
                return_exceptions=True,
            ),
            timeout=20,
        )
        assert all(isinstance(r, StateUnavailable) for r in results), results
        assert len({id(r) for r in results}) == 10  # each its own error, not one shared
    finally:
        await store.close()


async def test_a_put_on_a_closed_sqlite_store_fails_at_once(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    await store.close()
    with pytest.raises(StateUnavailable, match="closed database"):
        await asyncio.wait_for(put_record(store, "run", "late", b"{}", 60), timeout=5)


def script_calls(url: str) -> int:
    with redis.Redis.from_url(url) as admin:
        return int(admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


async def test_redis_splits_a_large_batch_into_calls_and_never_a_put(redis_url: str) -> None:
    """Redis reads a call whole and runs it without a pause: a batch of large records goes in
    calls of at most CALL_BYTES, each put's records together."""
    store = RedisStore(redis_url, prefix=f"batch-{secrets.token_hex(4)}:")
    try:
        await put_record(store, "run", "warm-up", b"{}", 60)  # the script is loaded
        before = script_calls(redis_url)
        value = b"x" * (1024 * 1024 - 8192)  # four such puts fit a call, with their keys
        pairs = [
            [Record("conversation", f"r{i}", value), Record("response", f"r{i}", b"{}")]
            for i in range(9)
        ]
        await asyncio.gather(*(store.put_records(pair, 60) for pair in pairs))
        assert script_calls(redis_url) - before == 3  # the first at once, then four and four
        for i in range(9):
            assert await store.get_record("conversation", f"r{i}") == value
            assert await store.get_record("response", f"r{i}") == b"{}"
        # However small, at most 1,000 records a call.
        before = script_calls(redis_url)
        await asyncio.gather(*(put_record(store, "run", f"s{i}", b"", 60) for i in range(2001)))
        assert script_calls(redis_url) - before == 3
    finally:
        await store.close()


async def test_a_stopped_redis_writer_fails_what_it_had_and_leaves_the_way_free(
    redis_url: str,
) -> None:
    """Puts left waiting for a later one to carry them would wait for ever, then land after a
    newer value of their key."""
    store = RedisStore(redis_url, prefix=f"batch-{secrets.token_hex(4)}:")
    try:
        big = b"x" * (3 * 1024 * 1024)  # one a call
        first = asyncio.create_task(put_record(store, "run", "same", b"first", 60))
        await asyncio.sleep(0)  # on its way: the next ones wait for the writer
        queued = [
            asyncio.create_task(put_record(store, "run", "same", b"%d" % i + big, 60))
            for i in range(3)
        ]
        await first
        await asyncio.sleep(0)  # the writer sends the first of them
        assert store._writer is not None
        store._writer.cancel()
        results = await asyncio.wait_for(asyncio.gather(*queued, return_exceptions=True), 10)
        assert all(isinstance(r, StateUnavailable) for r in results), results
        await put_record(store, "run", "same", b"newest", 60)
        await asyncio.sleep(0.2)
        assert await store.get_record("run", "same") == b"newest"
    finally:
        await store.close()


def test_batches_keep_the_order_and_never_split_a_put() -> None:
    sizes = [3, 1, 2, 9, 1, 1, 4]
    grouped = list(batches(sizes, lambda size: size, 4))
    assert grouped == [[3, 1], [2], [9], [1, 1], [4]]
    assert list(batches([], lambda size: size, 4)) == []
