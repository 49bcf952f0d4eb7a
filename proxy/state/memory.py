"""State in this process only: lost on restart, not shared between processes."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager

from proxy.state.locks import KeyedLocks
from proxy.state.store import (
    Held,
    Holding,
    Record,
    StoredContext,
    check_at_once,
    check_put,
    check_ttl,
    conflict,
    first_within,
)

SWEEP_AFTER = 1024  # the fewest puts between two sweeps of expired records
# The most records kept: past it the oldest go first, so a busy process's memory stays bounded
# whatever the TTLs (one process's recent runs are what this backend is for).
MAX_RECORDS = 10_000


class MemoryStore:
    def __init__(self, context_ttl_s: float | None = None) -> None:
        """`context_ttl_s`: a context ends this long after it was last saved (None: never)."""
        self._context_ttl = context_ttl_s
        self._threads: dict[str, Counter[str]] = {}
        # The monotonic ends of threads reserved with a TTL, the soonest first; at most
        # MAX_RECORDS (past it the soonest goes, as records do: its chain's records went first).
        self._thread_ends: OrderedDict[str, float] = OrderedDict()
        # id -> (version, stored form, monotonic end or inf)
        self._contexts: dict[str, tuple[int, bytes, float]] = {}
        # (kind, key) -> (monotonic deadline, value)
        self._records: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()
        self._puts_to_sweep = SWEEP_AFTER
        self._locks = KeyedLocks()

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int], ttl_s: float | None = None
    ) -> tuple[bool, dict[str, int]]:
        self._drop_if_ended(thread_id)
        if ttl_s is not None:
            self._end_thread_in(thread_id, ttl_s)
        counts = self._threads.setdefault(thread_id, Counter())
        if any(counts[key] >= limit for key, limit in limits.items()):
            return False, {key: counts[key] for key in limits}
        for key in limits:
            counts[key] += 1
        return True, {key: counts[key] for key in limits}

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        self._drop_if_ended(thread_id)
        return dict(self._threads.get(thread_id, {}))

    async def release(self, thread_id: str, counts: Mapping[str, int]) -> None:
        kept = self._threads.get(thread_id, Counter())
        for key, n in counts.items():
            if kept[key] > 0:
                kept[key] = max(0, kept[key] - n)

    def _end_thread_in(self, thread_id: str, ttl_s: float) -> None:
        self._thread_ends.pop(thread_id, None)  # ends later than any other: last
        self._thread_ends[thread_id] = time.monotonic() + check_ttl(ttl_s)
        if len(self._thread_ends) > MAX_RECORDS:
            soonest, _ = self._thread_ends.popitem(last=False)
            self._threads.pop(soonest, None)

    def _drop_if_ended(self, thread_id: str) -> None:
        end = self._thread_ends.get(thread_id)
        if end is not None and end <= time.monotonic():
            del self._thread_ends[thread_id]
            self._threads.pop(thread_id, None)

    async def load_context(self, context_id: str) -> StoredContext | None:
        found = self._context(context_id)
        if found is None:
            return None
        context = StoredContext.loads(found[1])
        context.version = found[0]
        return context

    async def save_context(self, context: StoredContext) -> None:
        await self._save(context, held=False)

    async def _save(self, context: StoredContext, held: bool) -> None:
        """`save_context`; `held`: the save of a hold, for which a context that ended while it
        was held (`context_ttl_s`) is the one it read: no one else can have changed it."""
        found = self._contexts.get(context.id) if held else self._context(context.id)
        current = found[0] if found is not None else context.version if held else 0
        if current != context.version:
            raise conflict(context.id)
        version = context.version + 1
        ttl = self._context_ttl
        end = math.inf if ttl is None else time.monotonic() + ttl
        self._contexts[context.id] = (version, compact(context.dumps(version)), end)
        context.version = version

    async def delete_context(self, context_id: str) -> bool:
        found = self._context(context_id) is not None
        self._contexts.pop(context_id, None)
        return found

    def _context(self, context_id: str) -> tuple[int, bytes, float] | None:
        found = self._contexts.get(context_id)
        if found is not None and found[2] <= time.monotonic():
            del self._contexts[context_id]
            return None
        return found

    async def put_records(
        self,
        records: Sequence[Record],
        ttl_s: float,
        keep_thread: str | None = None,
        keep: Sequence[tuple[str, str]] = (),
    ) -> int:
        until = time.monotonic() + check_put(records, ttl_s, keep)
        found = 0
        for kind, key in keep:  # the newest again too: the oldest go first (MAX_RECORDS)
            if (value := self._found(kind, key)) is not None:
                del self._records[(kind, key)]
                self._records[(kind, key)] = (until, value)
                found += 1
        for kind, key, value in records:
            self._records.pop((kind, key), None)  # a replaced record is the newest again
            self._records[(kind, key)] = (until, compact(value))
            if len(self._records) > MAX_RECORDS:
                self._records.popitem(last=False)
            self._puts_to_sweep -= 1
        if keep_thread is not None:
            self._drop_if_ended(keep_thread)
            if keep_thread in self._threads:
                self._end_thread_in(keep_thread, ttl_s)
        if self._puts_to_sweep <= 0:
            self._sweep()
        return found

    async def get_record(self, kind: str, key: str) -> bytes | None:
        return self._found(kind, key)

    async def get_records(
        self, wanted: Sequence[tuple[str, str]], max_bytes: int | None = None
    ) -> list[bytes | None]:
        check_at_once(wanted)
        found = [self._found(kind, key) for kind, key in wanted]
        return found[: first_within([len(value or b"") for value in found], max_bytes)]

    def _found(self, kind: str, key: str) -> bytes | None:
        found = self._records.get((kind, key))
        if found is None:
            return None
        until, value = found
        if until <= time.monotonic():
            del self._records[(kind, key)]
            return None
        return value

    async def delete_records(self, wanted: Sequence[tuple[str, str]]) -> int:
        check_at_once(wanted)
        now = time.monotonic()
        found = [self._records.pop(pair, None) for pair in wanted]
        return sum(record is not None and record[0] > now for record in found)

    def _sweep(self) -> None:
        """Drops expired records that nobody asked for again, and ended threads."""
        now = time.monotonic()
        # A new dict, as a dict does not shrink when entries are deleted.
        self._records = OrderedDict(
            (k, found) for k, found in self._records.items() if found[0] > now
        )
        if self._context_ttl is not None:
            gone = [context_id for context_id, found in self._contexts.items() if found[2] <= now]
            for context_id in gone:
                del self._contexts[context_id]
        while self._thread_ends and next(iter(self._thread_ends.values())) <= now:
            ended, _ = self._thread_ends.popitem(last=False)
            self._threads.pop(ended, None)
        # Waiting as many puts as there are records left makes each put pay O(1) towards the
        # next sweep, and keeps the dict within twice what the last sweep left (or SWEEP_AFTER).
        self._puts_to_sweep = max(SWEEP_AFTER, len(self._records))

    def hold(self, context_id: str) -> AbstractAsyncContextManager[Holding]:
        return self._hold(context_id)

    @contextlib.asynccontextmanager
    async def _hold(self, context_id: str) -> AsyncIterator[Holding]:
        async with self._locks.hold(context_id):
            saving = functools.partial(self._save, held=True)
            yield Held(self, await self.load_context(context_id), saving)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


def compact(value: bytes) -> bytes:
    """`value` in an allocation of its own size: orjson's output keeps a buffer of at least
    4 KiB, which a store of many small records would otherwise hold on to."""
    return bytes(memoryview(value))
