"""The upstreams' connection pool, bounded with a wait that ends: a request that cannot get a
connection within the pool timeout fails with 503 `upstream_pool_exhausted` instead of queueing
silently behind a thousand open streams.

A connection is held from the request until its response is closed (the callers close every
response they get), and released at once when the request fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from proxy.errors import UpstreamPoolExhausted


class _Released(httpx.AsyncByteStream):
    """A response body that gives its pool slot back when it is closed (once)."""

    def __init__(self, inner: httpx.AsyncByteStream, release: asyncio.Semaphore) -> None:
        self.inner = inner
        self.slot: asyncio.Semaphore | None = release

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.inner.__aiter__()  # the inner stream's own iterator: no layer per chunk

    async def aclose(self) -> None:
        try:
            await self.inner.aclose()
        finally:
            if self.slot is not None:
                self.slot.release()
                self.slot = None


class BoundedTransport(httpx.AsyncBaseTransport):
    """At most `connections` requests in flight through `inner`; the next waits at most
    `pool_timeout_s` for one to finish."""

    def __init__(
        self, inner: httpx.AsyncBaseTransport, connections: int, pool_timeout_s: float
    ) -> None:
        self.inner = inner
        self.connections = connections
        self.pool_timeout_s = pool_timeout_s
        self._slots = asyncio.Semaphore(connections)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._slots.locked():  # else a slot is free and taken at once, with no timer
            await self._wait_for_slot()
        else:
            await self._slots.acquire()
        try:
            response = await self.inner.handle_async_request(request)
        except BaseException:
            self._slots.release()
            raise
        stream = response.stream
        if isinstance(stream, httpx.AsyncByteStream) and not isinstance(stream, httpx.ByteStream):
            response.stream = _Released(stream, self._slots)
        else:  # a body already in memory holds no connection
            self._slots.release()
        return response

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
