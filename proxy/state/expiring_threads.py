"""A thread's tool call counts (SPEC §9) as runs reserve them: each thread's ending `ttl_s` after
its last counted call (a client names any thread it likes, `loop.thread_id`, a header, a
context, and counters kept for good grew the backend by one entry a name without end), and a
reservation whole even when its run is cancelled while it is made."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.state.store import StateStore

log = logging.getLogger(__name__)

Reserved = tuple[bool, dict[str, int]]


@dataclass(slots=True)
class ExpiringThreads:
    """The store's thread counters, each thread's dropped once `ttl_s` passed without a
    reservation (or, for a chain of stored responses, a response kept with it); `None`: kept
    for good.

    A run cancelled (its client gone) while its reservation is under way no longer knew whether
    the backend made it, and the count stayed for a call that never ran (200 clients cut at
    random: 38 counted too many): the reservation runs to its end, and what it took is given
    back."""

    store: StateStore
    ttl_s: float | None
    _giving_back: set[asyncio.Task[None]] = field(default_factory=set)

    async def reserve(self, thread_id: str, limits: Mapping[str, int]) -> Reserved:
        reserving = asyncio.ensure_future(self.store.reserve(thread_id, limits, ttl_s=self.ttl_s))
        try:
            return await asyncio.shield(reserving)
        except asyncio.CancelledError:
            giving = asyncio.ensure_future(self._give_back(thread_id, limits, reserving))
            self._giving_back.add(giving)
            giving.add_done_callback(self._giving_back.discard)
            raise

    async def _give_back(
        self, thread_id: str, limits: Mapping[str, int], reserving: asyncio.Future[Reserved]
    ) -> None:
        try:
            reserved, _ = await reserving
        except Exception:  # (the store's failures are StateUnavailable): nothing reserved
            return
        if reserved:
            try:
                await self.store.release(thread_id, dict.fromkeys(limits, 1))
            except Exception as exc:
                log.warning("the thread %s kept a call that never ran: %s", thread_id, exc)

    async def settle(self, timeout_s: float) -> None:
        """Waits, at most `timeout_s`, for the reservations being given back (at shutdown)."""
        if self._giving_back:
            await asyncio.wait(list(self._giving_back), timeout=timeout_s)

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        return await self.store.thread_counts(thread_id)

    async def release(self, thread_id: str, counts: Mapping[str, int]) -> None:
        await self.store.release(thread_id, counts)
