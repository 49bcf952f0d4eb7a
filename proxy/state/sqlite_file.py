"""The sqlite file itself: which file a path names (one deleted or replaced under a process is
noticed, and a worker that replaces another opens the file the server started with, or none),
and opening it beside other processes (its journal mode, steps retried while it is locked)."""

from __future__ import annotations

import os
import random
import sqlite3
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

FileIdentity = tuple[int, int]  # device and inode


def file_identity(path: str) -> FileIdentity:
    """Raises OSError when there is no such file."""
    found = os.stat(path)
    return found.st_dev, found.st_ino


def current(path: str) -> FileIdentity | None:
    """The identity of the file at `path` now; None when there is none."""
    try:
        return file_identity(path)
    except OSError:
        return None


def while_locked(step: Callable[[], T], timeout_s: float) -> T:
    """`step`, tried again while another process holds the file: workers that start together
    open one new file together, and a journal mode change does not wait on sqlite's busy
    timeout, it fails at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return step()
        except sqlite3.OperationalError as exc:
            if not _locked(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(0.01 + random.random() * 0.04)


def use_journal(db: sqlite3.Connection, journal: str, timeout_s: float, gone: bool) -> None:
    """Puts `db` in the `journal` mode (`wal`, else the rollback journal); raises ValueError
    when another process keeps the file in the other one (`gone`: the file is no longer there,
    `db` is a stand-in in memory that takes any mode). `db` is closed then."""
    wanted = "wal" if journal == "wal" else "delete"
    try:
        (mode,) = while_locked(
            lambda: db.execute(f"PRAGMA journal_mode={wanted}").fetchone(), timeout_s
        )
    except sqlite3.OperationalError as exc:
        db.close()
        if not _locked(exc):
            raise
        raise ValueError(  # another process kept it in the other mode, likely
            f"cannot use the {journal} journal: {exc} (another process has the file open, "
            "in the other journal mode if its state.sqlite_journal differs: it must be the "
            "same for every process)"
        ) from None
    if mode != wanted and not gone:
        db.close()
        raise ValueError(
            f"cannot use the {journal} journal: the file is in {mode} mode and open in "
            "another process (state.sqlite_journal must be the same for every process)"
        )


def _locked(error: sqlite3.OperationalError) -> bool:
    return "locked" in str(error) or "busy" in str(error)


def read_only(error: BaseException) -> bool:
    """`error` is sqlite's refusal to write with a connection it opened read-only (not with
    one whose file was deleted or replaced under it: opened again, it would make a new one)."""
    code = getattr(error, "sqlite_errorcode", 0)
    return (
        isinstance(error, sqlite3.Error)
        and code & 0xFF == sqlite3.SQLITE_READONLY
        and code != sqlite3.SQLITE_READONLY_DBMOVED
    )


def connect(path: str, timeout_s: float) -> sqlite3.Connection:
    """A connection to the file at `path` (or `:memory:`), waiting `timeout_s` at most for
    another's lock, in autocommit, usable from any one thread at a time. The file is never
    memory-mapped: one that changes under a mapping (made immutable, truncated) would kill the
    process with SIGBUS instead of failing a call. (WAL's `-shm` file is mapped all the same:
    the `rollback` journal maps nothing.)"""
    db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA mmap_size=0")
    return db
