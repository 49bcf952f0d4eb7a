"""State in this process only: lost on restart, not shared between processes."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager

from proxy.state.locks import KeyedLocks
from proxy.state.store import StoredContext

SWEEP_EVERY = 1024  # puts between two sweeps of expired records


class MemoryStore:
    def __init__(self) -> None:
        self._threads: dict[str, Counter[str]] = {}
        self._contexts: dict[str, bytes] = {}
        self._records: dict[tuple[str, str], tuple[float, bytes]] = {}
        self._puts = 0
        self._locks = KeyedLocks()

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int]
    ) -> tuple[bool, dict[str, int]]:
        counts = self._threads.setdefault(thread_id, Counter())
        if any(counts[key] >= limit for key, limit in limits.items()):
            return False, {key: counts[key] for key in limits}
        for key in limits:
            counts[key] += 1
        return True, {key: counts[key] for key in limits}

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        return dict(self._threads.get(thread_id, {}))

    async def load_context(self, context_id: str) -> StoredContext | None:
        data = self._contexts.get(context_id)
        return None if data is None else StoredContext.loads(data)

    async def save_context(self, context: StoredContext) -> None:
        self._contexts[context.id] = context.dumps()

    async def delete_context(self, context_id: str) -> bool:
        return self._contexts.pop(context_id, None) is not None

    async def put_record(self, kind: str, key: str, value: bytes, ttl_s: float) -> None:
        now = time.monotonic()
        self._records[(kind, key)] = (now + ttl_s, value)
        self._puts += 1
        if self._puts % SWEEP_EVERY == 0:  # expired records do not pile up
            expired = [k for k, (until, _) in self._records.items() if until <= now]
            for k in expired:
                del self._records[k]

    async def get_record(self, kind: str, key: str) -> bytes | None:
        found = self._records.get((kind, key))
        if found is None:
            return None
        until, value = found
        if until <= time.monotonic():
            del self._records[(kind, key)]
            return None
        return value

    def hold(self, context_id: str) -> AbstractAsyncContextManager[None]:
        return self._locks.hold(context_id)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
