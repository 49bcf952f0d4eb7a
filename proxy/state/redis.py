"""State in a redis server, shared by every proxy process: thread counts are reserved by one
Lua script (atomic), contexts may expire, and runs on one context are serialised by a lock."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager

import redis.asyncio as aioredis

from proxy.state.store import StoredContext, check_ttl

# KEYS[1]: the thread's hash; ARGV: key1, limit1, key2, limit2, ...
# Returns {ok, count1, count2, ...}: the counts after, or as they are when one is at its limit.
_RESERVE = """
local n = #ARGV / 2
local counts = {}
local ok = 1
for i = 1, n do
  counts[i] = tonumber(redis.call('HGET', KEYS[1], ARGV[2 * i - 1]) or '0')
  if counts[i] >= tonumber(ARGV[2 * i]) then ok = 0 end
end
if ok == 1 then
  for i = 1, n do counts[i] = redis.call('HINCRBY', KEYS[1], ARGV[2 * i - 1], 1) end
end
table.insert(counts, 1, ok)
return counts
"""

LOCK_LEASE_S = 600.0  # a run holding a context longer than this loses its lock


class RedisStore:
    def __init__(
        self, url: str, *, prefix: str = "loopwarden:", context_ttl_s: float | None = None
    ) -> None:
        self._redis = aioredis.Redis.from_url(url)
        self._prefix = prefix
        self._ttl = context_ttl_s
        self._reserve = self._redis.register_script(_RESERVE)

    def _thread(self, thread_id: str) -> str:
        return f"{self._prefix}thread:{thread_id}"

    def _context(self, context_id: str) -> str:
        return f"{self._prefix}context:{context_id}"

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int]
    ) -> tuple[bool, dict[str, int]]:
        keys = list(limits)
        args: list[str | int] = []
        for key in keys:
            args += [key, limits[key]]
        reply = await self._reserve(keys=[self._thread(thread_id)], args=args)
        return bool(reply[0]), {key: int(n) for key, n in zip(keys, reply[1:], strict=True)}

    async def thread_counts(self, thread_id: str) -> dict[str, int]:
        found = await self._redis.hgetall(self._thread(thread_id))
        return {_text(key): int(value) for key, value in found.items()}

    async def load_context(self, context_id: str) -> StoredContext | None:
        data = await self._redis.get(self._context(context_id))
        return None if data is None else StoredContext.loads(data)

    async def save_context(self, context: StoredContext) -> None:
        ttl = None if self._ttl is None else max(1, round(self._ttl * 1000))
        await self._redis.set(self._context(context.id), context.dumps(), px=ttl)

    async def delete_context(self, context_id: str) -> bool:
        return bool(await self._redis.delete(self._context(context_id)))

    def _record(self, kind: str, key: str) -> str:
        # The kind's length keeps (kind, key) pairs apart whatever ':' either holds.
        return f"{self._prefix}record:{len(kind)}:{kind}:{key}"

    async def put_record(self, kind: str, key: str, value: bytes, ttl_s: float) -> None:
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        await self._redis.set(self._record(kind, key), value, px=ttl_ms)

    async def get_record(self, kind: str, key: str) -> bytes | None:
        found = await self._redis.get(self._record(kind, key))
        if found is None:
            return None
        return found.encode() if isinstance(found, str) else bytes(found)

    async def delete_record(self, kind: str, key: str) -> bool:
        return bool(await self._redis.delete(self._record(kind, key)))

    def hold(self, context_id: str) -> AbstractAsyncContextManager[None]:
        return self._hold(context_id)

    @contextlib.asynccontextmanager
    async def _hold(self, context_id: str) -> AsyncIterator[None]:
        lock = self._redis.lock(
            f"{self._prefix}lock:{context_id}", timeout=LOCK_LEASE_S, sleep=0.01
        )
        async with lock:
            yield

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
