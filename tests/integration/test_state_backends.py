"""The state backends against one contract: memory, sqlite (a file) and a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import sqlite3
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import redis.asyncio as aioredis

from proxy.config.state import StateConfig
from proxy.errors import StateUnavailable
from proxy.state import redis_epoch, sqlite_records
from proxy.state import sqlite as sqlite_state
from proxy.state.backend import open_store
from proxy.state.memory import SWEEP_AFTER, MemoryStore
from proxy.state.redis import RedisStore
from proxy.state.sqlite import SqliteStore
from proxy.state.sqlite_file import file_identity
from proxy.state.store import RECORDS_AT_ONCE, Record, StateStore, StoredContext, conflict
from tests.records import delete_record, put_record
from tests.servers import free_port, redis_process, redis_server


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, redis_url: str
) -> AsyncIterator[StateStore]:
    store = opened(request.param, tmp_path, redis_url)
    yield store
    await store.close()


def opened(kind: str, tmp_path: Path, redis_url: str, **state: Any) -> StateStore:
    """A store of the backend `kind`, with `state` settings, keys of its own on redis."""
    os.environ["LOOPWARDEN_TEST_REDIS"] = redis_url
    config = StateConfig(
        backend=kind,  # type: ignore[arg-type]
        path=str(tmp_path / "state.db"),
        url_env="LOOPWARDEN_TEST_REDIS",
        key_prefix=f"test-{secrets.token_hex(4)}:",
        **state,
    )
    return open_store(config)


async def test_reserve_adds_one_to_every_counter_or_to_none(store: StateStore) -> None:
    assert await store.reserve("t", {"search": 2, "*": 3}) == (True, {"search": 1, "*": 1})
    assert await store.reserve("t", {"search": 2, "*": 3}) == (True, {"search": 2, "*": 2})
    assert await store.reserve("t", {"search": 2, "*": 3}) == (False, {"search": 2, "*": 2})
    assert await store.reserve("t", {"fetch": 5, "*": 3}) == (True, {"fetch": 1, "*": 3})
    assert await store.reserve("t", {"fetch": 5, "*": 3}) == (False, {"fetch": 1, "*": 3})
    assert await store.thread_counts("t") == {"search": 2, "*": 3, "fetch": 1}
    assert await store.thread_counts("other") == {}


async def test_release_takes_from_each_counter_none_below_zero(store: StateStore) -> None:
    for _ in range(3):
        await store.reserve("t", {"search": 3, "*": 5})
    await store.release("t", {"search": 2, "*": 1})
    assert await store.thread_counts("t") == {"search": 1, "*": 2}
    await store.release("t", {"search": 5, "fetch": 1})  # none below 0, none made
    await store.release("other", {"search": 1})
    assert (await store.thread_counts("t")).get("search", 0) == 0
    assert (await store.thread_counts("t")).get("fetch", 0) == 0
    assert await store.reserve("t", {"search": 1, "*": 5}) == (True, {"search": 1, "*": 3})


async def test_a_limit_of_zero_refuses_the_first_call(store: StateStore) -> None:
    assert await store.reserve("t", {"*": 0}) == (False, {"*": 0})
    assert await store.reserve("t", {"search": 0, "*": 5}) == (False, {"search": 0, "*": 0})
    assert await store.reserve("t", {"search": 1, "*": 0}) == (False, {"search": 0, "*": 0})
    assert await store.thread_counts("t") == {}


async def test_concurrent_reservations_are_exact(store: StateStore) -> None:
    """More at once than a process has connections to redis: the calls past them wait."""
    results = await asyncio.gather(*(store.reserve("busy", {"x": 25}) for _ in range(250)))
    assert sum(ok for ok, _ in results) == 25
    assert await store.thread_counts("busy") == {"x": 25}


async def test_a_thread_reserved_with_a_ttl_ends_unless_kept(store: StateStore) -> None:
    for thread in ("kept", "left", "for good", "kept later"):
        ttl = 0.3 if thread in ("kept", "left") else None
        assert await store.reserve(thread, {"x": 5}, ttl_s=ttl) == (True, {"x": 1})
    assert await store.reserve("left", {"x": 5}, ttl_s=0.3) == (True, {"x": 2})
    await asyncio.sleep(0.2)
    await store.put_records([], 0.3, keep_thread="kept")  # puts its end off; the others' stays
    # A thread without a TTL gets one, kept with the records written with it.
    await store.put_records([Record("response", "r", b"{}")], 0.3, keep_thread="kept later")
    await store.put_records([], 0.1, keep_thread="never reserved")  # nothing to keep
    await asyncio.sleep(0.2)
    assert await store.thread_counts("left") == {}
    await store.put_records([], 5, keep_thread="left")  # too late: it ended
    assert await store.thread_counts("left") == {}
    assert await store.thread_counts("kept") == {"x": 1}
    assert await store.reserve("left", {"x": 5}, ttl_s=0.3) == (True, {"x": 1})  # anew
    await asyncio.sleep(0.35)
    assert await store.thread_counts("kept") == {}
    assert await store.thread_counts("kept later") == {}
    assert await store.thread_counts("never reserved") == {}
    assert await store.reserve("for good", {"x": 5}) == (True, {"x": 2})


async def test_ended_threads_are_swept_away() -> None:
    memory = MemoryStore()
    await memory.reserve("chain", {"x": 5}, ttl_s=0.05)
    await memory.reserve("context", {"x": 5})
    await asyncio.sleep(0.1)
    memory._sweep()
    assert list(memory._threads) == ["context"]


async def test_sqlite_sweeps_ended_threads_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    await store.reserve("chain", {"x": 5, "y": 5}, ttl_s=0.05)
    await store.reserve("context", {"x": 5})
    await asyncio.sleep(0.1)
    monkeypatch.setattr(sqlite_state, "SWEEP_EVERY_S", 0.0)
    await put_record(store, "run", "r", b"x", 60)  # a write sweeps
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute("SELECT thread_id FROM thread_calls").fetchall()
        ends = db.execute("SELECT count(*) FROM thread_ends").fetchone()
    assert (rows, ends) == ([("context",)], (0,))
    await store.close()


async def test_contexts_round_trip_and_delete(store: StateStore) -> None:
    assert await store.load_context("c1") is None
    ctx = StoredContext("c1", agent="a", messages=[{"role": "user", "content": "hé"}])
    await store.save_context(ctx)
    loaded = await store.load_context("c1")
    assert loaded == ctx
    assert loaded is not ctx
    assert await store.delete_context("c1") is True
    assert await store.delete_context("c1") is False
    assert await store.load_context("c1") is None


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
async def test_a_context_ends_context_ttl_s_after_it_was_last_saved(
    kind: str, tmp_path: Path, redis_url: str
) -> None:
    """`state.context_ttl_s` on every backend: a context left alone that long is gone (read,
    held, deleted), its id free for a new one, and the sqlite file no longer holds it."""
    store = opened(kind, tmp_path, redis_url, context_ttl_s=1.0)
    try:
        await store.save_context(StoredContext("kept", agent="a"))
        await store.save_context(StoredContext("left", agent="a"))
        await asyncio.sleep(0.6)
        kept = await store.load_context("kept")
        assert kept is not None
        await store.save_context(kept)  # saved again: another second from now
        await asyncio.sleep(0.6)
        assert await store.load_context("left") is None
        assert (await store.load_context("kept")) is not None
        async with store.hold("left") as holding:
            assert holding.context is None
        assert await store.delete_context("left") is False
        await store.save_context(StoredContext("left", agent="b"))  # a new one, not a conflict
        again = await store.load_context("left")
        assert again is not None
        assert (again.agent, again.version) == ("b", 1)
        await asyncio.sleep(1.2)
        if kind == "sqlite":  # the first write sweeps what ended before it
            await put_record(store, "run", "r", b"{}", 60)
            with contextlib.closing(sqlite3.connect(tmp_path / "state.db")) as db:
                assert db.execute("SELECT count(*) FROM contexts").fetchone() == (0,)
        assert await store.load_context("kept") is None
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
async def test_a_context_that_ends_while_a_run_holds_it_is_saved_by_that_run(
    kind: str, tmp_path: Path, redis_url: str
) -> None:
    """A run longer than `context_ttl_s` (or begun just before its end): nobody else could
    change the context while it held it, so its turn is saved, not refused as a conflict."""
    store = opened(kind, tmp_path, redis_url, context_ttl_s=0.5)
    try:
        await store.save_context(StoredContext("c", agent="a"))
        async with store.hold("c") as holding:
            context = holding.context
            assert context is not None
            await asyncio.sleep(0.8)  # it ended meanwhile
            await put_record(store, "run", "r", b"{}", 60)  # sqlite: swept by the first write
            context.messages = [{"role": "user", "content": "a long run"}]
            await holding.end(context, [], 60)
        saved = await store.load_context("c")
    finally:
        await store.close()
    assert saved is not None
    assert (saved.messages, saved.version) == ([{"role": "user", "content": "a long run"}], 2)


async def test_a_save_fails_when_another_saved_the_context_since_it_was_read(
    store: StateStore,
) -> None:
    await store.save_context(StoredContext("c", agent="a"))
    late = await store.load_context("c")
    first = await store.load_context("c")
    assert late is not None
    assert first is not None
    first.messages = [{"role": "user", "content": "first"}]
    await store.save_context(first)
    late.messages = [{"role": "user", "content": "late"}]
    with pytest.raises(StateUnavailable, match="were not saved"):
        await store.save_context(late)
    kept = await store.load_context("c")
    assert kept is not None
    assert kept.messages == first.messages
    first.messages.append({"role": "assistant", "content": "again"})
    await store.save_context(first)  # the winner's copy is current: it saves again


async def test_a_context_is_created_once_and_not_revived_by_a_late_save(
    store: StateStore,
) -> None:
    one, two = StoredContext("new", agent="a"), StoredContext("new", agent="b")
    await store.save_context(one)
    with pytest.raises(StateUnavailable):
        await store.save_context(two)  # both read "no context": the second would overwrite
    loaded = await store.load_context("new")
    assert loaded is not None
    assert loaded.agent == "a"
    assert await store.delete_context("new") is True
    with pytest.raises(StateUnavailable):
        await store.save_context(loaded)  # deleted while it was held
    assert await store.load_context("new") is None


async def test_hold_serialises_work_on_one_context(store: StateStore) -> None:
    inside: list[str] = []
    overlaps = 0

    async def work(name: str, context: str) -> None:
        nonlocal overlaps
        async with store.hold(context):
            overlaps += any(c == context for c in inside)
            inside.append(context)
            await asyncio.sleep(0.01)
            inside.remove(context)

    await asyncio.gather(*(work(str(i), "same") for i in range(5)), work("x", "other"))
    assert overlaps == 0


async def test_a_call_cancelled_at_any_point_of_it_ends_cancelled(store: StateStore) -> None:
    """redis's client sends each command under `asyncio.wait_for`, which on Python 3.11 drops
    a cancellation that comes as the write completes: the store raises it instead."""
    await put_record(store, "run", "r1", b"{}", 60)
    for turns in range(8):
        reading = asyncio.create_task(store.get_record("run", "r1"))
        for _ in range(turns):
            await asyncio.sleep(0)
        if reading.cancel():  # False: it had ended already
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            assert reading.cancelled(), f"cancelled after {turns} turns, it went on"


async def test_cleanup_that_runs_while_a_cancellation_is_handled_is_not_cut_short(
    store: StateStore,
) -> None:
    written: list[str] = []

    async def cancelled_then_cleaning_up() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            for key in ("a", "b"):
                await put_record(store, "run", key, b"{}", 60)
                written.append(key)
            raise

    task = asyncio.create_task(cancelled_then_cleaning_up())
    await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert written == ["a", "b"]


async def test_sqlite_counts_and_contexts_survive_a_restart(tmp_path: Path) -> None:
    first = SqliteStore(tmp_path / "db.sqlite")
    await first.reserve("t", {"search": 9})
    await first.save_context(StoredContext("c", model="m"))
    await first.close()
    second = SqliteStore(tmp_path / "db.sqlite")
    assert await second.thread_counts("t") == {"search": 1}
    loaded = await second.load_context("c")
    assert loaded is not None
    assert loaded.model == "m"
    await second.close()


async def test_redis_contexts_expire_after_their_ttl(redis_url: str) -> None:
    store = RedisStore(redis_url, prefix=f"ttl-{secrets.token_hex(4)}:", context_ttl_s=0.2)
    await store.save_context(StoredContext("c", agent="a"))
    assert await store.load_context("c") is not None
    await asyncio.sleep(0.4)
    assert await store.load_context("c") is None
    await store.close()


async def test_sqlite_ping_succeeds_until_the_database_is_closed(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    await store.ping()
    await store.close()
    with pytest.raises(StateUnavailable, match="closed"):
        await store.ping()


async def test_redis_ping_succeeds_until_the_server_stops(tmp_path: Path) -> None:
    with redis_server(tmp_path) as url:
        store = RedisStore(url, prefix=f"ping-{secrets.token_hex(4)}:")
        await store.ping()
    with pytest.raises(StateUnavailable, match=r"redis\) is unavailable: ConnectionError"):
        await store.ping()
    await store.close()


async def test_redis_calls_after_a_restart_find_the_server_again(tmp_path: Path) -> None:
    """Every pooled connection was closed by the restart: none fails a call."""
    port = free_port()
    with redis_server(tmp_path, port) as url:
        store = RedisStore(url, prefix=f"restart-{secrets.token_hex(4)}:")
        await asyncio.gather(*(store.reserve(f"t{i}", {"x": 9}) for i in range(20)))
    with redis_server(tmp_path, port):
        results = await asyncio.gather(*(store.reserve(f"t{i}", {"x": 9}) for i in range(20)))
        assert results == [(True, {"x": 1})] * 20  # a server with no state
        await store.close()


async def test_a_redis_release_sent_again_is_taken_once(redis_url: str) -> None:
    """A release whose reply was lost (a failover, a cut link) is sent again on a new
    connection: it was taken twice, and the thread ran more calls than its limit."""
    target = redis_url.removeprefix("redis://").split("/")[0].split(":")
    dropping = {"armed": False}

    async def forward(client: asyncio.StreamReader, server_writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await client.read(65536):
                server_writer.write(data)
                await server_writer.drain()
        server_writer.close()  # (redis then closes its side: `answer` ends)

    async def answer(server: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await server.read(65536):
                if dropping["armed"]:  # the command ran; its reply is lost with the link
                    dropping["armed"] = False
                    client_writer.transport.abort()
                    return
                client_writer.write(data)
                await client_writer.drain()
        client_writer.close()

    async def link(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(target[0], int(target[1]))
        await asyncio.gather(forward(reader, server_writer), answer(server_reader, writer))
        for each in (writer, server_writer):
            each.close()
            with contextlib.suppress(ConnectionError):
                await each.wait_closed()

    cut = await asyncio.start_server(link, "127.0.0.1", 0)
    port = cut.sockets[0].getsockname()[1]
    store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix=f"once-{secrets.token_hex(4)}:")
    try:
        for _ in range(5):
            await store.reserve("t", {"calls": 100})
        await store.release("other", {"calls": 1})  # the script known to redis
        dropping["armed"] = True
        await store.release("t", {"calls": 1})
        assert not dropping["armed"]  # a reply was lost
        assert await store.thread_counts("t") == {"calls": 4}
    finally:
        await store.close()
        cut.close()
        await cut.wait_closed()


def test_open_store_names_a_missing_redis_url() -> None:
    with pytest.raises(ValueError, match=r"state\.url_env: environment variable NO_SUCH_URL"):
        open_store(StateConfig(backend="redis", url_env="NO_SUCH_URL"))


_HAMMER = """
import asyncio, sys
from proxy.config.state import StateConfig
from proxy.errors import StateUnavailable
from proxy.state.backend import open_store

async def main():
    store = open_store(StateConfig.model_validate_json(sys.argv[1]))
    results = await asyncio.gather(*(store.reserve("shared", {"x": 60}) for _ in range(50)))
    print(sum(ok for ok, _ in results))
    await store.close()

asyncio.run(main())
"""


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
def test_two_processes_share_one_exact_thread_limit(
    backend: str, tmp_path: Path, redis_url: str
) -> None:
    config = StateConfig(
        backend=backend,  # type: ignore[arg-type]
        path=str(tmp_path / "shared.db"),
        url_env="LOOPWARDEN_TEST_REDIS",
        key_prefix=f"mp-{secrets.token_hex(4)}:",
    )
    env = dict(os.environ, LOOPWARDEN_TEST_REDIS=redis_url)
    if backend == "sqlite":
        SqliteStore(config.path)  # create the schema once before both start
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HAMMER, config.model_dump_json()],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(2)
    ]
    granted = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert sum(granted) == 60
    assert all(g > 0 for g in granted)


async def test_records_round_trip(store: StateStore) -> None:
    value = bytes(range(256))  # every byte, NUL included, comes back as it went in
    assert await store.get_record("run", "r1") is None
    await put_record(store, "run", "r1", value, 60)
    assert await store.get_record("run", "r1") == value
    await put_record(store, "run", "r2", b"", 60)
    assert await store.get_record("run", "r2") == b""


async def test_put_record_replaces_the_value_and_its_ttl(store: StateStore) -> None:
    await put_record(store, "run", "longer", b"one", 0.05)
    await put_record(store, "run", "longer", b"two", 60)
    await put_record(store, "run", "shorter", b"one", 60)
    await put_record(store, "run", "shorter", b"two", 0.05)
    assert await store.get_record("run", "longer") == b"two"
    assert await store.get_record("run", "shorter") == b"two"
    await asyncio.sleep(0.15)
    assert await store.get_record("run", "longer") == b"two"
    assert await store.get_record("run", "shorter") is None


async def test_delete_record_drops_it_once(store: StateStore) -> None:
    await put_record(store, "run", "r1", b"x", 60)
    await put_record(store, "run", "r2", b"y", 60)
    assert await delete_record(store, "run", "r1") is True
    assert await store.get_record("run", "r1") is None
    assert await delete_record(store, "run", "r1") is False
    assert await delete_record(store, "run", "never") is False
    assert await store.get_record("run", "r2") == b"y"


async def test_delete_records_drops_several_in_one_call(store: StateStore) -> None:
    """Of the pairs asked, the live ones: expired, missing and other records stay as they are."""
    for key in ("r1", "r2", "r3"):
        await put_record(store, "run", key, key.encode(), 60)
    await put_record(store, "run", "short", b"gone", 0.05)
    await put_record(store, "held", "r1", b"other kind", 60)
    await asyncio.sleep(0.15)
    wanted = [("run", "r1"), ("run", "r3"), ("run", "short"), ("run", "never")]
    assert await store.delete_records(wanted) == 2
    assert await store.get_records([*wanted, ("run", "r2"), ("held", "r1")]) == [
        *[None] * 4,
        b"r2",
        b"other kind",
    ]
    assert await store.delete_records(wanted) == 0
    assert await store.delete_records([]) == 0
    with pytest.raises(ValueError, match="at once"):
        await store.delete_records([("run", str(n)) for n in range(RECORDS_AT_ONCE + 1)])


async def test_record_kinds_do_not_collide(store: StateStore) -> None:
    # Pairs that read the same when naively joined with ':'.
    pairs = [("run", "r1"), ("held_calls", "r1"), ("a:b", "c"), ("a", "b:c"), ("", "a:b:c")]
    pairs += [("a:b:c", ""), ("3:a", "b"), ("3", "a:b"), ("1", "1:a:b")]
    for kind, key in pairs:
        await put_record(store, kind, key, f"{kind}|{key}".encode(), 60)
    for kind, key in pairs:
        assert await store.get_record(kind, key) == f"{kind}|{key}".encode()
    assert await delete_record(store, "a:b", "c") is True
    assert await store.get_record("a", "b:c") == b"a|b:c"
    assert await delete_record(store, "a:b", "c") is False


async def test_records_expire_after_their_ttl(store: StateStore) -> None:
    await put_record(store, "run", "short", b"gone", 0.05)
    await put_record(store, "run", "short too", b"gone", 0.05)
    await put_record(store, "run", "long", b"kept", 60)
    assert await store.get_record("run", "short") == b"gone"
    await asyncio.sleep(0.15)
    assert await store.get_record("run", "short") is None
    assert await delete_record(store, "run", "short too") is False
    assert await store.get_record("run", "long") == b"kept"


async def test_records_put_together_are_written_in_their_order(store: StateStore) -> None:
    records = [Record("conversation", "r", b"[]"), Record("response", "r", b"{}")]
    records += [Record("run", "same", b"first"), Record("run", "same", b"last")]
    await store.put_records(records, 60)
    assert await store.get_record("conversation", "r") == b"[]"
    assert await store.get_record("response", "r") == b"{}"
    assert await store.get_record("run", "same") == b"last"
    await store.put_records([Record("run", f"n{i}", b"%d" % i) for i in range(RECORDS_AT_ONCE)], 60)
    assert await store.get_record("run", f"n{RECORDS_AT_ONCE - 1}") == b"%d" % (RECORDS_AT_ONCE - 1)
    too_many = [Record("run", f"x{i}", b"x") for i in range(RECORDS_AT_ONCE + 1)]
    with pytest.raises(ValueError, match=f"at most {RECORDS_AT_ONCE} records"):
        await store.put_records(too_many, 60)
    assert await store.get_record("run", "x0") is None


async def test_records_are_read_together_in_the_order_asked(store: StateStore) -> None:
    await store.put_records([Record("held", "a", b"A"), Record("held", "b", b"")], 60)
    await put_record(store, "held", "gone", b"G", 0.05)
    await put_record(store, "other", "c", b"C", 60)
    await asyncio.sleep(0.1)
    asked = [("held", key) for key in ("b", "missing", "a", "gone", "c", "a")]
    asked += [("other", "c"), ("other", "a")]
    found = [b"", None, b"A", None, None, b"A", b"C", None]
    assert await store.get_records(asked) == found
    assert await store.get_records([]) == []
    with pytest.raises(ValueError, match=f"at most {RECORDS_AT_ONCE} records"):
        await store.get_records([("held", "a")] * (RECORDS_AT_ONCE + 1))


async def test_records_read_within_a_bound_are_the_first_that_fit(store: StateStore) -> None:
    await store.put_records([Record("r", key, key.encode() * 10) for key in "abcd"], 60)
    asked = [("r", "a"), ("r", "none"), ("r", "b"), ("r", "c"), ("r", "d")]
    assert await store.get_records(asked, max_bytes=25) == [b"a" * 10, None, b"b" * 10]
    assert await store.get_records(asked, max_bytes=0) == [b"a" * 10]  # the first, always
    assert len(await store.get_records(asked, max_bytes=40)) == 5


async def test_records_kept_by_a_put_last_as_long_as_it(store: StateStore) -> None:
    """What a stored conversation's tail does for the earlier records holding the rest of it;
    a record not there (never put, or ended) is not made or brought back."""
    await store.put_records([Record("part", k, k.encode()) for k in ("a", "b", "c")], 0.3)
    await put_record(store, "part", "ended", b"E", 0.05)
    await asyncio.sleep(0.1)
    kept = [("part", "a"), ("part", "missing"), ("part", "ended")]
    assert await store.put_records([Record("tail", "t", b"T")], 5, keep=kept) == 1  # found
    assert await store.put_records([], 5, keep_thread="none", keep=[("part", "b")]) == 1
    assert await store.put_records([Record("tail", "u", b"U")], 5) == 0
    await asyncio.sleep(0.4)
    parts = [("part", k) for k in ("a", "b", "c", "missing", "ended")]
    assert await store.get_records(parts) == [b"a", b"b", None, None, None]
    assert await store.get_record("tail", "t") == b"T"
    with pytest.raises(ValueError, match=f"at most {RECORDS_AT_ONCE} records"):
        await store.put_records([], 5, keep=[("part", "a")] * (RECORDS_AT_ONCE + 1))


def test_sqlite_finds_records_by_their_key_not_by_scanning_them(tmp_path: Path) -> None:
    """`(kind, key) IN (...)` with the expiry condition had sqlite scan its expiry index:
    every live record, 130 ms a continued response with 200,000 of them."""
    with contextlib.closing(sqlite3.connect(tmp_path / "plan.db")) as db:
        for statement in sqlite_records.TABLES:
            db.execute(statement)
        reads = [sqlite_records.read_pairs(what, 3) for what in ("r.value", "length(r.value)")]
        by_key = [sqlite_records.keep_pairs(3), sqlite_records.delete_pairs(3)]
        for query, lookups in [(reads[0], 1), (reads[1], 1), *((q, 3) for q in by_key)]:
            explained = db.execute(f"EXPLAIN QUERY PLAN {query}", [0] * query.count("?"))
            plan = " ".join(str(row[-1]) for row in explained)
            assert plan.count("USING INDEX sqlite_autoindex_records_1") == lookups, plan
            assert "records_by_expiry" not in plan, plan


@pytest.mark.parametrize("ttl_s", [0, -1.0, math.nan, math.inf])
async def test_put_record_refuses_a_ttl_not_positive_and_finite(
    store: StateStore, ttl_s: float
) -> None:
    with pytest.raises(ValueError, match="TTL must be a positive number"):
        await put_record(store, "run", "r1", b"x", ttl_s)
    assert await store.get_record("run", "r1") is None


async def test_memory_sweeps_expired_records_away() -> None:
    store = MemoryStore()
    for i in range(SWEEP_AFTER - 10):
        await put_record(store, "run", f"short{i}", b"x", 0.05)
    await asyncio.sleep(0.1)
    for i in range(100):  # the SWEEP_AFTER-th put sweeps
        await put_record(store, "run", f"long{i}", b"x", 60)
    assert sorted(store._records) == sorted(("run", f"long{i}") for i in range(100))


async def test_memory_sweeps_wait_longer_as_more_records_stay() -> None:
    store = MemoryStore()
    for i in range(2 * SWEEP_AFTER):
        await put_record(store, "run", f"long{i}", b"x", 60)
    # The sweep at this put left 2 * SWEEP_AFTER records: the next waits as many puts, so
    # each put pays O(1) for the sweeps.
    for i in range(SWEEP_AFTER // 2):
        await put_record(store, "run", f"short{i}", b"x", 0.05)
    await asyncio.sleep(0.1)
    for i in range(2 * SWEEP_AFTER - SWEEP_AFTER // 2 - 1):
        await put_record(store, "run", f"more{i}", b"x", 60)
    assert len(store._records) == 4 * SWEEP_AFTER - 1  # no sweep yet
    await put_record(store, "run", "last", b"x", 60)
    assert len(store._records) == 4 * SWEEP_AFTER - SWEEP_AFTER // 2


def _record_rows(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        (count,) = db.execute("SELECT count(*) FROM records").fetchone()
        return int(count)


async def test_sqlite_sweeps_expired_rows_away_at_most_once_a_minute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.db"
    store = SqliteStore(path)
    for i in range(3):
        await put_record(store, "run", f"short{i}", b"x", 0.05)
    await asyncio.sleep(0.1)
    await put_record(store, "run", "long1", b"x", 60)
    assert await store.get_record("run", "short0") is None
    assert _record_rows(path) == 4  # the first put swept, the next sweep is a minute away
    monkeypatch.setattr(sqlite_state, "SWEEP_EVERY_S", 0.0)
    await put_record(store, "run", "long2", b"x", 60)
    assert _record_rows(path) == 2
    await store.close()


async def test_sqlite_records_survive_a_restart(tmp_path: Path) -> None:
    first = SqliteStore(tmp_path / "state.db")
    await put_record(first, "run", "r1", b"kept", 60)
    await put_record(first, "run", "r2", b"dropped", 60)
    assert await delete_record(first, "run", "r2") is True
    await first.close()
    second = SqliteStore(tmp_path / "state.db")
    assert await second.get_record("run", "r1") == b"kept"
    assert await second.get_record("run", "r2") is None
    await second.close()


async def test_sqlite_calls_queued_behind_a_lock_fail_within_their_timeout(
    tmp_path: Path,
) -> None:
    """Another process holds the write lock: each call fails `timeout_s` after it was made,
    not after the calls before it each waited theirs (the eighth waited 8 times `timeout_s`)."""
    path = tmp_path / "state.db"
    store = SqliteStore(path, timeout_s=0.5)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.gather(
        *(store.reserve(f"t{i}", {"x": 5}) for i in range(8)), return_exceptions=True
    )
    took = loop.time() - started
    assert all(isinstance(r, StateUnavailable) for r in results)
    assert took < 2.5  # 8 times 0.5 s before
    holder.execute("ROLLBACK")
    assert await store.reserve("t0", {"x": 5}) == (True, {"x": 1})  # the lock was let go
    holder.close()
    await store.close()


async def test_redis_losing_the_proxy_s_data_is_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redis restarted empty (or flushed, or evicting keys) let every thread run its tools
    again from zero, with `/readyz` 200 and nothing in the log. Now a readiness check, or a
    call (at most every 5 s), tells it; an evicting `maxmemory-policy` is told at the first;
    and a redis at its memory limit, which answers pings and refuses writes, is not ready."""
    monkeypatch.setattr(redis_epoch, "CHECK_S", 0.0)
    with redis_process(tmp_path) as (url, _):
        admin = aioredis.Redis.from_url(url)
        await admin.config_set("maxmemory-policy", "allkeys-lru")
        lost: list[bool] = []
        store = RedisStore(url, prefix="lost:", on_data_lost=lambda: lost.append(True))
        with caplog.at_level(logging.WARNING, logger="proxy.state.redis_epoch"):
            await store.ping()
            assert "maxmemory-policy allkeys-lru" in caplog.text
            assert "lost" not in caplog.text
            await admin.flushall()
            await store.ping()
            assert caplog.text.count("redis lost the proxy's data") == 1
            await admin.flushall()
            await store.reserve("t", {"x": 5})  # (its check, in the background)
            await asyncio.wait_for(_told(caplog, 2), 5)
            await admin.flushall()
            await put_record(store, "run", "r1", b"kept", 60)  # (a write's too)
            await asyncio.wait_for(_told(caplog, 3), 5)
            assert len(lost) == 3  # and counted (`loopwarden_state_data_lost_total`)
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", "1")
        with pytest.raises(StateUnavailable):
            await store.ping()
        await admin.config_set("maxmemory", "0")
        await store.ping()
        await store.close()
        await admin.aclose()


async def _told(caplog: pytest.LogCaptureFixture, times: int) -> None:
    while caplog.text.count("redis lost the proxy's data") < times:  # noqa: ASYNC110 (a task's)
        await asyncio.sleep(0.02)


async def _taken(store: SqliteStore) -> tuple[bool, dict[str, int]]:
    """A reservation, tried until the store takes it."""
    while True:
        try:
            return await store.reserve("t", {"x": 5})
        except StateUnavailable:
            await asyncio.sleep(0.1)


def _immutable(files: list[str], on: bool) -> bool:
    """Whether the immutable flag of `files` could be set (`on`) or cleared."""
    flag = "+i" if on else "-i"
    return subprocess.run(["chattr", flag, *files], capture_output=True).returncode == 0


async def test_a_sqlite_store_opened_as_its_file_took_no_writes_takes_them_once_it_does(
    tmp_path: Path,
) -> None:
    """A worker that replaced another while the file was immutable had it opened read-only by
    sqlite, for good: 503 until restarted, the file writable again. (The rollback journal: with
    WAL, an immutable `-shm` file may fault the process, SIGBUS, as the README says.)"""
    path = tmp_path / "state.db"
    journal = "rollback"
    first = SqliteStore(path, timeout_s=0.5, journal=journal)
    await first.reserve("t", {"x": 5})
    files = [str(path)]
    if not await asyncio.to_thread(_immutable, files, True):
        await first.close()
        pytest.skip("this file system takes no immutable flag (chattr +i)")
    try:
        second = SqliteStore(path, timeout_s=0.5, journal=journal, opened=file_identity(str(path)))
        with pytest.raises(StateUnavailable, match="readonly"):
            await second.reserve("t", {"x": 5})
    finally:
        await asyncio.to_thread(_immutable, files, False)
    assert await asyncio.wait_for(_taken(second), 5) == (True, {"x": 2})  # (opened once a second)
    await second.close()
    await first.close()


async def test_sqlite_failures_are_told_once_a_second_with_their_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file that takes no writes fails every call: each was a line of the log (3,700 in 8 s
    with a full disk), where redis's are one a second."""
    path = tmp_path / "state.db"
    store = SqliteStore(path, timeout_s=0.2)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    with caplog.at_level(logging.WARNING, logger="proxy.state.sqlite"):
        results = await asyncio.gather(
            *(store.reserve(f"t{i}", {"x": 5}) for i in range(20)), return_exceptions=True
        )
    holder.execute("ROLLBACK")
    holder.close()
    await store.close()
    assert all(isinstance(r, StateUnavailable) for r in results)
    told = [r.getMessage() for r in caplog.records if r.name == "proxy.state.sqlite"]
    assert len(told) < 5, told  # 20 calls failing within 0.2 s or so: 20 lines before


async def test_a_release_that_failed_is_tried_again_while_the_lease_lasts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process held the write lock as a hold ended: its release failed, and the next
    hold of the context waited the whole lease (30 s) though the lock was free again at once."""
    path = tmp_path / "state.db"
    store = SqliteStore(path, timeout_s=0.3, lock_lease_s=30)
    holder = sqlite3.connect(path, isolation_level=None)
    async with store.hold("c"):
        holder.execute("BEGIN IMMEDIATE")
    assert "releasing the lock on context 'c' failed" in caplog.text
    holder.execute("ROLLBACK")
    holder.close()
    async with asyncio.timeout(10), store.hold("c") as held:
        assert held.context is None
    assert "the lock on context 'c' was let go on a later try" in caplog.text
    await store.close()


async def test_a_sqlite_hold_behind_a_lock_fails_within_its_timeout_once(tmp_path: Path) -> None:
    """The wait for a context fails `timeout_s` after it began: no release of a lock it never
    took waits another `timeout_s` after it (a `/chat` answered its 503 after twice as long)."""
    path = tmp_path / "state.db"
    store = SqliteStore(path, timeout_s=1.0)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(StateUnavailable):
        async with store.hold("c"):
            pass
    took = loop.time() - started
    holder.execute("ROLLBACK")
    holder.close()
    assert 1.0 <= took < 1.8  # 2 s before
    async with asyncio.timeout(1), store.hold("c") as held:  # nothing was left held
        assert held.context is None
        await held.end(None, [], 60)
    await store.close()


async def test_a_sqlite_store_that_found_the_servers_file_gone_stays_unavailable(
    tmp_path: Path,
) -> None:
    """A worker that replaces another while the file is away opens none; when the same file
    comes back (moved away and back: the same inode) it must not serve a database of its own
    beside the others: it stays unavailable until the server restarts."""
    path = tmp_path / "state.db"
    first = SqliteStore(path)
    await put_record(first, "k", "x", b"shared", 3600)
    opened = file_identity(str(path))
    path.rename(tmp_path / "moved.db")
    replacing = SqliteStore(path, opened=opened)
    (tmp_path / "moved.db").rename(path)
    try:
        with pytest.raises(StateUnavailable, match="deleted or replaced"):
            await replacing.get_record("k", "x")
        with pytest.raises(StateUnavailable):
            await put_record(replacing, "k", "y", b"lost", 3600)
        assert await first.get_record("k", "x") == b"shared"  # the file the others serve
    finally:
        await replacing.close()
        await first.close()


async def test_sqlite_calls_take_turns_on_one_thread_of_the_store(tmp_path: Path) -> None:
    """Calls in flight together do not each take a thread to wait for the connection in."""
    store = SqliteStore(tmp_path / "state.db")
    before = set(threading.enumerate())  # (not their idents: a thread ended may give its own)
    try:
        await asyncio.gather(*(put_record(store, "run", f"r{i}", b"v", 60) for i in range(64)))
        assert [await store.get_record("run", f"r{i}") for i in (0, 63)] == [b"v", b"v"]
        started = [t.name for t in threading.enumerate() if t not in before]
        # One for the calls, and the write-ahead log's checkpointer.
        assert sorted(started) == ["loopwarden-sqlite-checkpoint_0", "loopwarden-sqlite_0"]
    finally:
        await store.close()


def _sizes(*paths: Path) -> list[int]:
    return [path.stat().st_size for path in paths]


@pytest.mark.parametrize("writers", [1, 2])
async def test_the_sqlite_log_stays_bounded_under_writers_that_never_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writers: int
) -> None:
    """Connections writing all the time (one worker under load; two workers on one file): the
    write-ahead log is copied into the file beside them, on a thread of its own, and begins
    again, instead of growing with every write (passive copies alone never let it)."""
    import proxy.state.sqlite_checkpoints as checkpoints

    monkeypatch.setattr(checkpoints, "RESTART_FRAMES", 64)  # ~256 KiB
    monkeypatch.setattr(checkpoints, "FEW_FRAMES", 16)
    monkeypatch.setattr(checkpoints, "LONG_LOG_FRAMES", 256)
    monkeypatch.setattr(checkpoints, "EVERY_S", 0.005)
    path = tmp_path / "state.db"
    wal = Path(f"{path}-wal")
    before = set(threading.enumerate())
    stores = [SqliteStore(path) for _ in range(writers)]
    value = b"x" * 4096  # a page or more per record
    largest = 0

    async def write(store: SqliteStore, name: str) -> None:
        nonlocal largest
        for i in range(3_000 // writers):
            await put_record(store, "run", f"{name}-{i}", value, 3600.0)
            largest = max(largest, *_sizes(wal))  # a stat, between two writes

    try:
        await asyncio.gather(*(write(store, f"w{n}") for n, store in enumerate(stores)))
        started = set(threading.enumerate()) - before
        assert (
            sorted(t.name for t in started if "checkpoint" in t.name)
            == ["loopwarden-sqlite-checkpoint_0"] * writers
        )
        # Seen: 1-3 MB here, 26 MB with both cores busy with other work; with passive copies
        # alone, or none, 66 MB (every page written).
        assert largest < 40 * 1024 * 1024, f"the log held {largest} bytes"
        # The records are in the file itself, once the checkpointer's last copy (a moment
        # after the last write, on a busy host) is done.
        for _ in range(100):
            (file,) = await asyncio.to_thread(_sizes, path)
            if file > 3_000 * len(value):
                break
            await asyncio.sleep(0.1)
        assert file > 3_000 * len(value)
        last = f"w{writers - 1}-{3_000 // writers - 1}"
        assert [await stores[-1].get_record("run", k) for k in ("w0-0", last)] == [value] * 2
    finally:
        for store in stores:
            await store.close()
    assert not [t for t in started if t.is_alive() and "checkpoint" in t.name]  # closed too


async def test_the_memory_backend_keeps_at_most_max_records_oldest_out_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import proxy.state.memory as memory

    monkeypatch.setattr(memory, "MAX_RECORDS", 3)
    store = MemoryStore()
    for key in ("a", "b", "c"):
        await put_record(store, "run", key, key.encode(), 60)
    await put_record(store, "run", "a", b"a2", 60)  # replaced: the newest again
    await put_record(store, "run", "d", b"d", 60)
    assert await store.get_record("run", "b") is None  # the oldest went
    assert [await store.get_record("run", k) for k in ("a", "c", "d")] == [b"a2", b"c", b"d"]


async def test_the_memory_backend_holds_small_records_in_small_allocations() -> None:
    """orjson's output sits in a 4 KiB buffer; a store of 1,000 small reports holds ~100 KiB."""
    store = MemoryStore()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for i in range(1000):
            await put_record(store, "run", f"r{i}", orjson.dumps({"run_id": i}), 60)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - before < 1_000_000


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_a_held_context_stays_held_past_its_lease_while_its_holder_lives(
    backend: str, tmp_path: Path, redis_url: str
) -> None:
    """The lease is renewed while it is held: a run longer than the lease keeps its context."""
    prefix = f"renew-{secrets.token_hex(4)}:"

    def one() -> StateStore:
        if backend == "sqlite":
            return SqliteStore(tmp_path / "state.db", lock_lease_s=1)
        return RedisStore(redis_url, prefix=prefix, lock_lease_s=1)

    holder, waiter = one(), one()
    order: list[str] = []
    held = asyncio.Event()

    async def hold_long() -> None:
        async with holder.hold("c"):
            order.append("held")
            held.set()
            await asyncio.sleep(2.5)  # two and a half leases
            order.append("released")

    async def wait_then_hold() -> None:
        await held.wait()
        async with waiter.hold("c"):
            order.append("taken")

    await asyncio.gather(hold_long(), wait_then_hold())
    await holder.close()
    await waiter.close()
    assert order == ["held", "released", "taken"]


def _script_calls(url: str) -> int:
    with redis.Redis.from_url(url) as admin:
        return int(admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


async def test_the_runs_of_one_process_waiting_for_a_context_ask_redis_as_one(
    redis_url: str,
) -> None:
    """Twenty requests wait behind a run (of another process) that holds their context: one of
    them asks redis whether it is free, the others wait their turn in the process, so redis is
    asked as often as for one waiter (were twenty, each every 10 ms); each takes it in turn."""
    prefix = f"wait-{secrets.token_hex(4)}:"
    holder, store = RedisStore(redis_url, prefix=prefix), RedisStore(redis_url, prefix=prefix)
    taken: list[int] = []

    async def wait(n: int) -> None:
        async with store.hold("c"):
            taken.append(n)

    try:
        async with holder.hold("c"):
            waiting = [asyncio.create_task(wait(n)) for n in range(20)]
            await asyncio.sleep(0.1)
            before = await asyncio.to_thread(_script_calls, redis_url)
            await asyncio.sleep(1)
            tries = await asyncio.to_thread(_script_calls, redis_url) - before
        await asyncio.wait_for(asyncio.gather(*waiting), 5)
    finally:
        await holder.close()
        await store.close()
    assert sorted(taken) == list(range(20))
    assert tries <= 100, f"{tries} tries of the lock in 1 s"  # one waiter's, every 10 ms


async def test_a_context_held_in_turn_by_one_process_gives_another_its_turn(
    redis_url: str,
) -> None:
    """Twenty runs of one process queue for a context, each holding it 20 ms; a run of another
    process comes 5 ms after the first: it is served next, not after the twenty (the waiters of
    one process hand the context on among themselves without a round trip, so they would
    always be first without the other's waiting mark)."""
    prefix = f"turns-{secrets.token_hex(4)}:"
    busy, other = RedisStore(redis_url, prefix=prefix), RedisStore(redis_url, prefix=prefix)
    order: list[str] = []

    async def run(store: StateStore, name: str, after_s: float) -> None:
        await asyncio.sleep(after_s)
        async with store.hold("c"):
            order.append(name)
            await asyncio.sleep(0.02)

    try:
        runs = [run(busy, f"busy-{i}", 0.001 * i) for i in range(20)]
        await asyncio.wait_for(asyncio.gather(*runs, run(other, "other", 0.005)), 10)
    finally:
        await busy.close()
        await other.close()
    assert order.index("other") <= 2, order


def test_a_context_stored_by_a_later_version_is_read_without_its_new_fields() -> None:
    """A replica not yet upgraded reads what an upgraded one saved."""
    later = {"version": 3, "id": "c", "owner": "a", "messages": [], "colour": "blue"}
    read = StoredContext.loads(orjson.dumps(later))
    assert (read.id, read.owner, read.version) == ("c", "a", 3)
    assert b'"thread"' not in StoredContext("c").dumps(1)  # written only when it has one


def test_a_lost_save_names_the_context_as_its_client_does() -> None:
    """Kept as `<key>/<id>`: the key's name is not the client's to read in its error."""
    assert conflict("alice/x").message.startswith("context 'x' was changed or deleted")
    assert conflict("x").message.startswith("context 'x' was changed or deleted")


async def test_a_redis_call_fails_within_its_timeout_however_many_wait(tmp_path: Path) -> None:
    """A server that does not answer: each call fails within its `timeout_s`, also one that
    waited for a pooled connection first (130 calls on 100 connections)."""
    with redis_server(tmp_path) as url:
        store = RedisStore(url, timeout_s=2.0)
        assert await store.reserve("t", {"x": 5}) == (True, {"x": 1})  # connected
        pauser = redis.Redis.from_url(url)
        # WRITE: the scripts wait, the pauser's own commands do not (with ALL, redis-py 8's
        # UNPAUSE waited out the pause, past its socket timeout).
        pauser.execute_command("CLIENT", "PAUSE", 7000, "WRITE")
        loop = asyncio.get_running_loop()

        async def timed() -> float:
            started = loop.time()
            with pytest.raises(StateUnavailable):
                await store.reserve("t", {"x": 5})
            return loop.time() - started

        took = await asyncio.gather(*(timed() for _ in range(130)))  # past its 100 connections
        pauser.execute_command("CLIENT", "UNPAUSE")
        pauser.close()
        # Its timeout and some, never twice it (a busy host once added 0.75 s to every call).
        assert max(took) < 3.5, max(took)
        await store.close()
