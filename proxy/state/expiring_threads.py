"""A thread's tool call counts (SPEC §9) that end `ttl_s` after its last counted call: a
client names any thread it likes (`loop.thread_id`, a header, a context), and counters kept for
good grew the backend by one entry a name without end."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from proxy.state.store import StateStore


@dataclass(frozen=True, slots=True)
class ExpiringThreads:
    """The store's thread counters, each thread's dropped once `ttl_s` passed without a
    reservation (or, for a chain of stored responses, a response kept with it)."""

    store: StateStore
    ttl_s: float

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int]
    ) -> tuple[bool, dict[str, int]]:
        return await self.store.reserve(thread_id, limits, ttl_s=self.ttl_s)

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        return await self.store.thread_counts(thread_id)

    async def release(self, thread_id: str, counts: Mapping[str, int]) -> None:
        await self.store.release(thread_id, counts)
