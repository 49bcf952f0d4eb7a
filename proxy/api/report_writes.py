"""A run's report is written before its answer goes, for WAIT_S at most: a state backend that
is slow or down then delays an answer that long, no longer (a pass-through request waited
`state.timeout_s` on a paused redis); the write goes on in the background.

Written first, a report is read at once from any replica; one still being written is waited
for by `GET /v1/runs/{id}` in the process writing it. At most `max_pending` reports are written
in the background; past them, a run's answer waits for its own (a backend that does not answer
cannot pile up reports without end).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from functools import partial

from proxy.errors import StateUnavailable
from proxy.state.store import Record, StateStore
from proxy.throttled_log import ThrottledWarnings

log = logging.getLogger(__name__)

MAX_PENDING = 1024
WAIT_S = 0.1


class ReportWrites:
    def __init__(
        self,
        store: StateStore,
        ttl_s: float,
        max_pending: int = MAX_PENDING,
        wait_s: float = WAIT_S,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self.wait_s = wait_s
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._records: dict[str, Sequence[Record]] = {}  # what each pending write writes
        self._unkept = ThrottledWarnings(log)  # a backend down fails every run's: once a second

    async def keep(self, run_id: str, records: Sequence[Record]) -> None:
        """Writes `records`, the run's: for `wait_s` at most, then in the background (to its end
        when too many are being written). A backend that fails is logged. A write of the run
        still going on in the background is the one asked for again (its first try cut short),
        or goes first (an earlier report: this one is last)."""
        earlier = self._pending.get(run_id)
        if earlier is not None and self._records.get(run_id) == records:
            return
        write = self._write(run_id, records, earlier)
        if len(self._pending) >= self.max_pending:
            await write
            return
        task = asyncio.ensure_future(write)
        self._pending[run_id], self._records[run_id] = task, records
        task.add_done_callback(partial(self._written, run_id))
        await asyncio.sleep(0)  # its first turn: a backend in memory is done with it then
        if not task.done():
            await asyncio.wait((task,), timeout=self.wait_s)

    def _written(self, run_id: str, task: asyncio.Task[None]) -> None:
        if self._pending.get(run_id) is task:  # (not a later write of the run)
            del self._pending[run_id], self._records[run_id]

    async def written(self, run_id: str) -> None:
        """Returns once this process has no write of `run_id`'s report under way."""
        task = self._pending.get(run_id)
        if task is not None:
            await asyncio.shield(task)

    async def drain(self, timeout_s: float) -> None:
        """Waits for the reports being written, at most `timeout_s` (at shutdown); those left
        are told in the log with the count, as are the failures not told yet."""
        if self._pending:
            await asyncio.wait(list(self._pending.values()), timeout=timeout_s)
        left = list(self._pending.values())
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        if left:
            log.warning("%d run reports were not kept: still being written at shutdown", len(left))
        self._unkept.close("runs were not kept")

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def _write(
        self, run_id: str, records: Sequence[Record], after: asyncio.Task[None] | None = None
    ) -> None:
        if after is not None:
            await asyncio.wait((after,))
        try:
            await self.store.put_records(records, self.ttl_s)
        except StateUnavailable as exc:
            self._unkept.warning("run %s was not kept: %s", run_id, exc.message)
