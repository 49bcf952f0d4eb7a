"""One asyncio lock per key, dropped when nobody holds or waits for it: the waiters of one
process for a lock shared between processes take their turns here, and only the first asks
the backend."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

# The first and the longest wait between two tries of a lock that another process holds.
LOCK_POLL_S = (0.005, 0.02)


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def waiting(self, key: str) -> bool:
        """Whether anyone waits for `key` besides its holder."""
        return self._locks.get(key, (None, 0))[1] > 1

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
