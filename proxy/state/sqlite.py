"""State in one SQLite file: survives restarts, and processes that share the file share it
exactly: each reservation is one IMMEDIATE transaction, contexts are saved by compare-and-set,
and runs on one context are serialised by a leased lock row. A file deleted or replaced under
the process, or one it cannot write, makes every call a `StateUnavailable`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from proxy.errors import StateUnavailable
from proxy.state import sqlite_contexts as contexts
from proxy.state import sqlite_records as records_sql
from proxy.state import sqlite_threads as threads
from proxy.state.lease import LateReleases, renewed
from proxy.state.locks import LOCK_POLL_S, KeyedLocks
from proxy.state.sqlite_checkpoints import Checkpointer, leave_log_copies
from proxy.state.sqlite_file import (
    FileIdentity,
    connect,
    current,
    file_identity,
    read_only,
    use_journal,
    while_locked,
)
from proxy.state.store import (
    Holding,
    Record,
    StoredContext,
    batches,
    check_at_once,
    check_put,
    check_ttl,
    conflict,
    settle,
)
from proxy.throttled_log import ThrottledWarnings

log = logging.getLogger(__name__)
T = TypeVar("T")
SWEEP_EVERY_S = 60.0  # the most often expired records are deleted

_TABLES = [
    # Written by the readiness check.
    "CREATE TABLE IF NOT EXISTS probe (id INTEGER PRIMARY KEY, at REAL NOT NULL)",
]


class SqliteStore:
    def __init__(
        self,
        path: str | Path,
        *,
        timeout_s: float = 5.0,
        lock_lease_s: float = 30.0,
        journal: str = "wal",
        context_ttl_s: float | None = None,
        opened: FileIdentity | None = None,
    ) -> None:
        """`journal`: `wal` or `rollback` (see `StateConfig.sqlite_journal`);
        `context_ttl_s`: a context ends this long after it was last saved (None: never);
        `opened`: the file the server started with (a worker that replaces another): when
        the path names another file or none, no file is made and every call fails, as in
        the workers that had it open."""
        self._path = str(path)
        self._lease = lock_lease_s
        self._late = LateReleases()
        # A file that takes no writes fails every call, a lock held fails every one behind it.
        self._failures = ThrottledWarnings(log)
        self._late_calls = ThrottledWarnings(log)
        self._reopened_at = -math.inf  # monotonic
        self._timeout_s = timeout_s
        self._context_ttl = context_ttl_s
        gone = opened is not None and current(self._path) != opened
        self._gone = gone  # for good: a file back at the path later is not this store's
        if gone:
            log.warning("the sqlite state file %s was deleted or replaced: not made anew", path)
        in_memory = self._path == ":memory:" or gone
        if not in_memory:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = connect(":memory:" if gone else self._path, timeout_s)
        use_journal(self._db, journal, timeout_s, gone)
        self._db.execute("PRAGMA synchronous=NORMAL")
        while_locked(lambda: _create_schema(self._db), timeout_s)
        # The file this connection has open: one deleted or replaced under it is noticed.
        self._identity = opened if gone else None if in_memory else file_identity(self._path)
        # The log is copied into the file by a checkpointer (see sqlite_checkpoints), not in
        # the commit that makes it long.
        self._checkpoints: Checkpointer | None = None
        self._wal = not in_memory and journal == "wal"
        if self._wal:
            leave_log_copies(self._db)
            self._checkpoints = Checkpointer(self._path, timeout_s)
        # The connection's one thread: every call after start-up is made on it, in order, so
        # no two touch the connection at once (a thread per call, each waiting for the
        # connection, cost 64 wake-ups and switches at 64 requests in flight).
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="loopwarden-sqlite")
        self._swept = -math.inf  # monotonic; the first put sweeps what expired before it
        # Writes put and not yet taken by the thread, each with the future its put awaits.
        self._puts: list[tuple[records_sql.Write, asyncio.Future[int]]] = []
        self._puts_lock = threading.Lock()  # the loop adds to the list, the thread takes it
        self._puts_deadline = math.inf  # when the first of them was put, plus timeout_s
        self._locks = KeyedLocks()

    def _reopen(self) -> None:
        """A new connection in place of one sqlite opened read-only: the file took no writes
        as it was opened (immutable, a read-only mount), and the connection stays read-only
        once it takes them again (a replaced worker answered 503 until restarted). On the
        store's thread, once a second at most; one that fails leaves the old one."""
        now = time.monotonic()
        if now - self._reopened_at < 1.0:
            return
        self._reopened_at = now
        try:
            db = connect(self._path, self._timeout_s)
            db.execute("PRAGMA synchronous=NORMAL")
            if self._wal:
                leave_log_copies(db)
        except sqlite3.Error:
            return
        old, self._db = self._db, db
        old.close()

    def _check_file(self) -> None:
        if self._gone or (self._identity is not None and current(self._path) != self._identity):
            raise StateUnavailable(
                "the state backend (sqlite) is unavailable: its file was deleted or replaced "
                "since the proxy opened it; restart the proxy once the file is back"
            )

    async def _call(self, work: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self._timeout_s
        return await loop.run_in_executor(self._thread, self._on_thread, work, deadline)

    def _on_thread(self, work: Callable[[sqlite3.Connection], T], deadline: float) -> T:
        """Runs `work` on the store's thread, within `timeout_s` of when it was asked for: the
        calls queued before it (each waiting for a lock another process holds) count."""
        self._check_file()
        db = self._db
        try:
            self._wait_until(db, deadline)
            changes = db.total_changes
            result = work(db)
            if db.total_changes != changes and self._checkpoints is not None:
                self._checkpoints.wrote(db)
            return result
        except (sqlite3.Error, OSError) as exc:
            self._failures.warning("the sqlite state backend failed: %s", exc)
            _abandon(self._db)
            if read_only(exc):
                self._reopen()
            reason = f"the state backend (sqlite) is unavailable: {exc}"
            raise StateUnavailable(reason) from None

    def _wait_until(self, db: sqlite3.Connection, deadline: float) -> None:
        """Sets how long a statement may wait for another process's lock: until `deadline`
        (for every call: the checkpointer sets its own)."""
        left_ms = round((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            self._late_calls.warning("a sqlite state call waited its timeout_s behind others")
            raise StateUnavailable(
                f"the state backend (sqlite) is unavailable: the call waited its timeout_s "
                f"({self._timeout_s:g} s) for calls before it"
            )
        db.execute(f"PRAGMA busy_timeout={left_ms}")

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int], ttl_s: float | None = None
    ) -> tuple[bool, dict[str, int]]:
        ends_at = None if ttl_s is None else time.time() + check_ttl(ttl_s)
        return await self._call(lambda db: threads.reserve(db, thread_id, limits, ends_at))

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        return await self._call(lambda db: threads.counts(db, thread_id))

    async def release(self, thread_id: str, counts: Mapping[str, int]) -> None:
        await self._call(lambda db: threads.release(db, thread_id, counts))

    def _ended(self) -> float:
        """When the contexts saved last before it have ended (wall-clock, shared)."""
        return -math.inf if self._context_ttl is None else time.time() - self._context_ttl

    async def load_context(self, context_id: str) -> StoredContext | None:
        ended = self._ended()
        return await self._call(lambda db: contexts.read(db, context_id, ended))

    async def save_context(self, context: StoredContext) -> None:
        version = context.version + 1
        body, ended = context.dumps(version), self._ended()
        if not await self._call(lambda db: contexts.save(db, context, body, version, ended, False)):
            raise conflict(context.id)
        context.version = version

    async def _end(
        self,
        hold: _Hold,
        save: StoredContext | None,
        records: Sequence[Record],
        ttl_s: float,
    ) -> None:
        """`Holding.end` in one transaction: the save, refused while another token holds the
        context (this one's lease was lost and another run took it), and compared with the
        version read when another took it and let go since (a run may have saved it, or a
        `DELETE` dropped it); the records; and the lock row let go. Nothing written but the
        lock's release when the save is refused."""
        write = records_sql.Write(records, check_put(records, ttl_s), None, ()) if records else None
        version = 0 if save is None else save.version + 1
        body = b"" if save is None else save.dumps(version)
        ended = self._ended()

        def work(db: sqlite3.Connection) -> bool:
            with _immediate(db):
                holder = contexts.holder(db, hold.context_id)
                held = holder == hold.token
                saved = save is None or (
                    (held or holder is None) and contexts.save(db, save, body, version, ended, held)
                )
                if saved and write is not None:
                    records_sql.write([write], db)
                contexts.let_go(db, hold.context_id, hold.token)
                return saved

        saved = await self._call(work)
        hold.let_go = True
        if not saved:
            raise conflict(hold.context_id)
        if save is not None:
            save.version = version

    async def delete_context(self, context_id: str) -> bool:
        ended = self._ended()
        return await self._call(lambda db: contexts.delete(db, context_id, ended))

    async def put_records(
        self,
        records: Sequence[Record],
        ttl_s: float,
        keep_thread: str | None = None,
        keep: Sequence[tuple[str, str]] = (),
    ) -> int:
        """Written with the records put meanwhile (group commit, see `_write_puts`): it returns
        once the statement that wrote them is committed."""
        write = records_sql.Write(records, check_put(records, ttl_s, keep), keep_thread, keep)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        with self._puts_lock:
            puts, first = self._puts, not self._puts
            puts.append((write, done))
            if first:
                self._puts_deadline = time.monotonic() + self._timeout_s
        if first:  # the thread takes this batch, and any record put before it gets to it
            self._thread.submit(self._write_puts, loop)
        return await done

    def _write_puts(self, loop: asyncio.AbstractEventLoop) -> None:
        """Writes what was put so far, up to ROWS_PER_WRITE records in each statement (a put's
        records in one). One statement is one transaction, whose write lock sqlite holds inside
        that one call: an explicit transaction would hold it across the statements, each
        waiting for the GIL while the event loop runs, and another process's writers would
        wait their busy timeout for it. (The threads and records kept are kept before, in
        statements of their own: what is kept when the records then fail only lasts longer.)"""
        with self._puts_lock:
            puts, self._puts = self._puts, []
            deadline = self._puts_deadline
        now = time.time()
        clock = time.monotonic()
        if clock - self._swept >= SWEEP_EVERY_S:  # expired rows do not pile up
            self._swept = clock
            with contextlib.suppress(StateUnavailable):  # the writes below say so too
                self._on_thread(_statement(records_sql.SWEEP, (now,)), deadline)
                for sweep in threads.SWEEP:
                    self._on_thread(_statement(sweep, (now,)), deadline)
                if self._context_ttl is not None:
                    self._on_thread(_statement(contexts.SWEEP, (self._ended(),)), deadline)
        rows = records_sql.ROWS_PER_WRITE
        for chunk in batches(puts, lambda put: len(put[0].records), rows):
            error: BaseException | None = None
            kept: list[int] = []
            try:
                writes = [write for write, _ in chunk]
                kept = self._on_thread(functools.partial(records_sql.write, writes), deadline)
            except BaseException as exc:  # every put of the statement fails with it
                error = exc
            loop.call_soon_threadsafe(settle, [done for _, done in chunk], error, kept)

    async def get_record(self, kind: str, key: str) -> bytes | None:
        return await self._call(lambda db: records_sql.get(db, kind, key))

    async def get_records(
        self, wanted: Sequence[tuple[str, str]], max_bytes: int | None = None
    ) -> list[bytes | None]:
        check_at_once(wanted)
        if not wanted:
            return []
        return await self._call(lambda db: records_sql.get_many(db, wanted, max_bytes))

    async def delete_records(self, wanted: Sequence[tuple[str, str]]) -> int:
        check_at_once(wanted)
        if not wanted:
            return 0
        return await self._call(lambda db: records_sql.delete(db, wanted))

    def hold(self, context_id: str) -> AbstractAsyncContextManager[Holding]:
        return self._hold(context_id)

    @contextlib.asynccontextmanager
    async def _hold(self, context_id: str) -> AsyncIterator[Holding]:
        # One waiter per context and process polls the table; the others queue here.
        async with self._locks.hold(context_id):
            token = secrets.token_hex(16)

            async def renew() -> bool:
                return await self._call(
                    lambda db: contexts.renew(db, context_id, token, self._lease)
                )

            hold = _Hold(self, context_id, token)
            try:
                try:
                    hold.context = await self._take(context_id, token)
                except StateUnavailable:  # nothing taken: no release to wait its timeout for
                    hold.let_go = True
                    raise
                async with renewed(f"context {context_id!r}", self._lease, renew):
                    yield hold
            finally:  # also when the wait was cancelled, as its last attempt took the row
                if not hold.let_go:

                    async def let_go() -> None:
                        await self._call(lambda db: contexts.let_go(db, context_id, token))

                    try:
                        await let_go()
                    except StateUnavailable as exc:  # tried again while the lease lasts
                        log.warning("releasing the lock on context %r failed: %s", context_id, exc)
                        self._late.retry(f"context {context_id!r}", self._lease, let_go)

    async def _take(self, context_id: str, token: str) -> StoredContext | None:
        """Waits until this process holds the context's lock row (free, or its lease over);
        the context as stored then."""

        def work(db: sqlite3.Connection) -> tuple[bool, StoredContext | None]:
            with _immediate(db):  # taken and read, or neither (a call that failed took none)
                if not contexts.take(db, context_id, token, self._lease):
                    return False, None
                return True, contexts.read(db, context_id, self._ended())

        wait, longest = LOCK_POLL_S
        while not (taken := await self._call(work))[0]:
            await asyncio.sleep(wait)
            wait = min(wait * 2, longest)
        return taken[1]

    async def ping(self) -> None:
        """Fails unless the file is still the one opened and takes writes: one row written,
        the write-ahead log checkpointed into the file, and the file writable as the kernel
        says (a passive checkpoint writes nothing to it while another connection's copy is
        under way). Asked, not opened: closing a second descriptor of the file would drop
        this process's sqlite locks on it."""

        def work(db: sqlite3.Connection) -> None:
            db.execute("INSERT OR REPLACE INTO probe (id, at) VALUES (1, ?)", (time.time(),))
            db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            if self._identity is not None and not os.access(self._path, os.W_OK):
                raise OSError(f"{self._path} cannot be written (read-only or immutable)")

        await self._call(work)

    async def close(self) -> None:
        await self._late.close()
        # The thread stays for calls after this one, which fail as a closed database's do; it
        # ends with the store.
        await asyncio.get_running_loop().run_in_executor(self._thread, self._close)

    def _close(self) -> None:
        self._failures.close("the sqlite state backend failed")  # the count not told yet
        self._late_calls.close("sqlite state calls waited their timeout_s behind others")
        if self._checkpoints is not None:
            self._checkpoints.close()
        self._db.close()


@contextlib.contextmanager
def _immediate(db: sqlite3.Connection) -> Iterator[None]:
    """A write transaction taken at once (no other writer between its reads and writes)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


@dataclass(slots=True)
class _Hold:
    """A context held by this process (`SqliteStore.hold`), under its lock row's `token`."""

    store: SqliteStore
    context_id: str
    token: str
    context: StoredContext | None = None
    let_go: bool = False  # the lock row was let go by `end`

    async def end(
        self, save: StoredContext | None, records: Sequence[Record], ttl_s: float
    ) -> None:
        await self.store._end(self, save, records, ttl_s)


def _statement(sql: str, parameters: Sequence[object]) -> Callable[[sqlite3.Connection], object]:
    return lambda db: db.execute(sql, parameters)


def _abandon(db: sqlite3.Connection) -> None:
    """Rolls back what a failed call left open (a COMMIT that failed keeps its transaction),
    so that the next call can begin its own."""
    with contextlib.suppress(sqlite3.Error):
        if db.in_transaction:
            db.execute("ROLLBACK")


def _create_schema(db: sqlite3.Connection) -> None:
    """Creates the tables, and adds what older files lack, in one transaction (processes that
    open one file at once do not race)."""
    with _immediate(db):
        for statement in [*threads.TABLES, *records_sql.TABLES, *contexts.TABLES, *_TABLES]:
            db.execute(statement)
        contexts.add_versions(db)
