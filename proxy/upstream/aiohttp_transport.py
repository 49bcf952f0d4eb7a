"""The upstreams' transport: aiohttp's client, used directly (no request or response objects of
another library on top), over one pool of kept-alive connections."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from yarl import URL

from proxy.upstream.transport import Answer, Body, Failure, Headers, Timeouts

# What aiohttp would add on its own: the request goes with the headers it was given.
NOT_ADDED = ("User-Agent", "Accept", "Content-Type")
URL_CACHE = 1024  # parsed URLs kept: a run's upstream URL is parsed once, not per call


class AiohttpAnswer:
    __slots__ = ("_response",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status

    def header(self, name: str) -> str | None:
        return self._response.headers.get(name)

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return list(self._response.raw_headers)

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.content.iter_any()

    async def aclose(self) -> None:
        # Back to the pool when the body was read to its end, else the connection is closed.
        self._response.release()


class AiohttpTransport:
    """At most `connections` connections open; idle ones kept `keepalive_s`. The session is
    made on the first request, inside the event loop that serves it."""

    def __init__(self, connections: int = 1000, keepalive_s: float = 60.0) -> None:
        self.connections = connections
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[Timeouts, aiohttp.ClientTimeout] = {}
        self._urls: dict[str, URL] = {}

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self.connections, limit_per_host=0, keepalive_timeout=self.keepalive_s
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=NOT_ADDED,
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        return self._session

    async def send(
        self, method: str, url: str, headers: Headers, body: Body, timeouts: Timeouts
    ) -> Answer:
        session = self._session or self._open()
        response = await session.request(
            method,
            self._url(url),
            headers=headers,
            data=body,
            allow_redirects=False,
            timeout=self._timeout(timeouts),
        )
        return AiohttpAnswer(response)

    def _url(self, url: str) -> URL:
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= URL_CACHE:
                self._urls.clear()
            # As given: a percent-encoded `/` in a relayed id stays encoded.
            parsed = self._urls[url] = URL(url, encoded=True)
        return parsed

    def _timeout(self, timeouts: Timeouts) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(timeouts)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=timeouts.connect_s, sock_read=timeouts.read_s
            )
            self._timeouts[timeouts] = timeout
        return timeout

    def failure(self, exc: BaseException) -> Failure | None:
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return Failure.CONNECT_TIMEOUT
        if isinstance(exc, aiohttp.ClientConnectorError):
            return Failure.UNREACHABLE
        if isinstance(exc, aiohttp.ServerTimeoutError):
            return Failure.TIMEOUT
        if isinstance(exc, aiohttp.ClientError):
            return Failure.BROKEN  # reset, closed, a body cut short, an answer that is not HTTP
        return None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
