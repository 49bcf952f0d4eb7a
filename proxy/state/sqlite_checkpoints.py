"""Checkpoints of a sqlite file's write-ahead log, off the requests' path.

By default sqlite copies the log into the file when a commit finds it long (1,000 pages), in
that commit, with the fsyncs of the copy: one write in a few hundred then took 5 to 15 ms instead
of 0.2, the tail latency of every request that stores a run. The store's connection turns that
off (`wal_autocheckpoint=0`), and a `Checkpointer` does the copy every `every_s` on a connection
and a thread of its own. Its checkpoints are PASSIVE: they wait for no reader or writer, of
this process or another, and what one leaves for later the next takes up."""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger(__name__)
CHECKPOINT_EVERY_S = 1.0


class Checkpointer:
    """Checkpoints the log of the file `db` has open every `every_s`, until `stop`."""

    def __init__(self, db: sqlite3.Connection, every_s: float = CHECKPOINT_EVERY_S) -> None:
        self._db = db
        self._every_s = every_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="loopwarden-sqlite-checkpoints", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        failing = False
        try:
            while not self._stopped.wait(self._every_s):
                try:
                    self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    failing = False
                except sqlite3.Error as exc:  # the file's faults are the store's to report
                    if not failing:
                        log.warning("checkpointing the sqlite state file failed: %s", exc)
                    failing = True
        finally:
            self._db.close()

    def stop(self) -> None:
        """Ends the checkpoints (a checkpoint under way finishes first) and closes their
        connection. Safe to call from any thread, more than once."""
        self._stopped.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
