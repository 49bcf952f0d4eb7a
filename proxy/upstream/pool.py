"""The upstreams' connection pool, bounded with a wait that ends: a request that cannot get a
connection within the pool timeout fails with 503 `upstream_pool_exhausted` instead of queueing
silently behind a thousand open streams.

A connection is held from the request until its answer is closed (the callers close every
answer they get), and released at once when the request fails. (A body's end still to come
after the caller closed it, read in the background to keep the connection, counts against the
transport's own limit only, for at most a moment.)
"""

from __future__ import annotations

import asyncio

from proxy.errors import UpstreamPoolExhausted
from proxy.upstream.transport import (
    Answer,
    AnswerOver,
    Body,
    Failure,
    Headers,
    Timeouts,
    Transport,
)


class _Held(AnswerOver):
    """An answer that gives its pool slot back when it is closed (once)."""

    __slots__ = ("_slot",)

    def __init__(self, answer: Answer, slot: asyncio.Semaphore) -> None:
        super().__init__(answer)
        self._slot: asyncio.Semaphore | None = slot

    async def aclose(self) -> None:
        try:
            await self._answer.aclose()
        finally:
            if self._slot is not None:
                self._slot.release()
                self._slot = None


class BoundedTransport:
    """At most `connections` requests in flight through `inner`; the next waits at most
    `pool_timeout_s` for one to finish."""

    def __init__(self, inner: Transport, connections: int, pool_timeout_s: float) -> None:
        self.inner = inner
        self.connections = connections
        self.pool_timeout_s = pool_timeout_s
        self._slots = asyncio.Semaphore(connections)

    async def send(
        self, method: str, url: str, headers: Headers, body: Body, timeouts: Timeouts
    ) -> Answer:
        if self._slots.locked():  # else a slot is free and taken at once, with no timer
            await self._wait_for_slot()
        else:
            await self._slots.acquire()
        try:
            answer = await self.inner.send(method, url, headers, body, timeouts)
        except BaseException:
            self._slots.release()
            raise
        return _Held(answer, self._slots)

    def failure(self, exc: BaseException) -> Failure | None:
        return self.inner.failure(exc)

    async def _wait_for_slot(self) -> None:
        try:
            async with asyncio.timeout(self.pool_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise UpstreamPoolExhausted(
                f"all {self.connections} upstream connections were busy for "
                f"{self.pool_timeout_s:g}s (server.upstream_connections); retry later"
            ) from None

    async def aclose(self) -> None:
        await self.inner.aclose()
