"""Checkpoints of a sqlite file's write-ahead log, off the requests' path.

By default sqlite copies the log into the file in the commit that takes it past 1,000 pages,
with the copy's fsync: that write, and every state call of the process queued behind it on the
store's one thread, waited 10-17 ms. The store's connection turns that off
(`wal_autocheckpoint=0`) and tells a `Checkpointer` of its writes, which copies on a connection
and a thread of its own, at most every EVERY_S: a passive copy, which holds no lock a writer
waits for.

A passive copy lets the log begin again (at the next write) only if it caught up with every
write, which a process that writes all the time seldom allows. Once the log holds
RESTART_FRAMES, passive copies go on until one finds little written during the one before, and
a restarting copy follows, on the store's thread after its next write: it holds writers off
only while it copies that little, and the next write begins the log again, in the same file
(cutting the file back is a write of its own, 3 ms for 4 MB: only a file past LOG_FILE_BYTES
is cut)."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from proxy.state.sqlite_file import connect, read_only

log = logging.getLogger(__name__)
EVERY_S = 0.1  # the most often the log is copied while writes go on
RESTART_FRAMES = 1000  # pages in the log (sqlite's own checkpoint's) that have it begin again
# A log file that grew past this (a burst of writes) is cut back to it when the log begins again.
LOG_FILE_BYTES = 16 * 1024 * 1024
CATCH_UP_COPIES = 4  # passive copies at most before a restarting one
FEW_FRAMES = 64  # frames written during a passive copy that the restarting one may copy
# The longest a restarting copy waits for other connections (one reading for long would hold
# every call of the store), until the log holds LONG_LOG_FRAMES.
RESTART_WAIT_MS = 10
LONG_LOG_FRAMES = 4 * RESTART_FRAMES


def leave_log_copies(db: sqlite3.Connection) -> None:
    """`db`, a store's connection, leaves copying the log into the file to the checkpointer."""
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.execute(f"PRAGMA journal_size_limit={LOG_FILE_BYTES}")


class Checkpointer:
    """Copies the log of the sqlite file at `path` after writes. `wrote` and `close` are called
    on the store's thread."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self._timeout_ms = int(timeout_s * 1000)  # the store's busy timeout, as sqlite3 sets it
        self._path = path
        self._db = connect(self._path, 0)  # passive copies wait for no lock
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="loopwarden-sqlite-checkpoint")
        self._due = False  # a copy is asked for and not yet begun
        self._last = -EVERY_S  # monotonic: when the last copy began
        # The log is long and copied but for a little: the longest the restarting copy may wait
        # for other connections (ms), or None.
        self._restart: int | None = None
        self._closed = threading.Event()
        self._failing = False  # the last copy failed (logged once until one succeeds)

    def wrote(self, db: sqlite3.Connection) -> None:
        """After a write on `db`, the store's connection. The restarting copy is made on it,
        between two of its statements: no other statement of this process is under way then,
        to wait for or to be held off."""
        wait_ms = self._restart
        if wait_ms is not None:
            try:
                self._restart_log(db, wait_ms)
            except sqlite3.Error as exc:  # the write is done; the next copy tries again
                log.warning("checkpointing the sqlite state file failed: %s", exc)
            finally:
                self._restart = None  # copies may go on (it answers busy beside one)
        if not self._due:
            self._due = True
            self._thread.submit(self._copy)

    def _copy(self) -> None:
        if self._closed.wait(self._last + EVERY_S - time.monotonic()):
            return
        self._due = False  # writes from here on ask for the next copy
        if self._restart is not None:  # the store's thread has not made it yet
            return
        self._last = time.monotonic()
        try:
            frames, copied = self._passive()
            if frames >= RESTART_FRAMES:
                # Each passive copy takes up what was written during the one before; once that
                # is little, the restarting copy holds writers off only for what is left.
                for _ in range(CATCH_UP_COPIES):
                    frames, then = self._passive()
                    if then - copied <= FEW_FRAMES:
                        break
                    copied = then
                # Writers of other processes that never pause may keep a short wait from ever
                # finding the log free: a log grown past LONG_LOG_FRAMES waits as long as
                # any call of the store.
                long = frames >= LONG_LOG_FRAMES
                self._restart = self._timeout_ms if long else RESTART_WAIT_MS
            self._failing = False
        except sqlite3.Error as exc:  # the file's faults are the store's to report
            if not self._failing:
                log.warning("checkpointing the sqlite state file failed: %s", exc)
            self._failing = True
            if read_only(exc):  # opened as the file took no writes: it may take them again
                with contextlib.suppress(sqlite3.Error):
                    old, self._db = self._db, connect(self._path, 0)
                    old.close()

    def _passive(self) -> tuple[int, int]:
        """Frames in the log, and frames copied from it (of this log, by any connection)."""
        (_, frames, copied) = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return frames, copied

    def _restart_log(self, db: sqlite3.Connection, wait_ms: int) -> None:
        """A restarting copy on `db` that waits at most `wait_ms` for other connections'
        writers and readers, then gives `db` the store's busy timeout back; one that could not
        restart the log answers busy, and a later one tries again."""
        db.execute(f"PRAGMA busy_timeout={wait_ms}")
        try:
            db.execute("PRAGMA wal_checkpoint(RESTART)").fetchall()
        finally:
            db.execute(f"PRAGMA busy_timeout={self._timeout_ms}")

    def close(self) -> None:
        """Drops a copy asked for, waits for one under way, and closes the connection."""
        self._closed.set()
        self._thread.submit(self._db.close)
        self._thread.shutdown(wait=True)
