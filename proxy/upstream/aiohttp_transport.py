"""The upstreams' transport: aiohttp's client, used directly (no request or response objects of
another library on top), over one pool of kept-alive connections."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp
from yarl import URL

from proxy.upstream.transport import Answer, Body, Failure, Headers, Timeouts

# What aiohttp would add on its own: the request goes with the headers it was given.
NOT_ADDED = ("User-Agent", "Accept", "Content-Type")
URL_CACHE = 1024  # parsed URLs kept: a run's upstream URL is parsed once, not per call
# The end of a body that the caller did not need (a stream's last chunk after `[DONE]`) is
# read in the background to keep the connection, for at most this long and this many bytes.
END_WAIT_S = 0.5
END_BYTES = 65536


class AiohttpAnswer:
    __slots__ = ("_finish", "_keep", "_response")

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        finish: Callable[[aiohttp.ClientResponse], None],
    ) -> None:
        self._response = response
        # Reads the rest of a body in the background, then releases it; None once it has.
        self._finish: Callable[[aiohttp.ClientResponse], None] | None = finish
        self._keep = False

    @property
    def status(self) -> int:
        return self._response.status

    def header(self, name: str) -> str | None:
        return self._response.headers.get(name)

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return list(self._response.raw_headers)

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.content.iter_any()

    def keep_alive(self) -> None:
        self._keep = True

    async def aclose(self) -> None:
        # Back to the pool when the body was read to its end, else the connection is closed,
        # unless the caller said that only the body's end is left: that is read first.
        response, finish = self._response, self._finish
        if finish is None:
            return  # handed to the reader of its end, which releases it
        if self._keep and not response.content.is_eof():
            self._finish = None
            finish(response)
        else:
            response.release()


class AiohttpTransport:
    """At most `connections` connections open; idle ones kept `keepalive_s`. The session is
    made on the first request, inside the event loop that serves it."""

    def __init__(self, connections: int = 1000, keepalive_s: float = 60.0) -> None:
        self.connections = connections
        self.keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[Timeouts, aiohttp.ClientTimeout] = {}
        self._urls: dict[str, URL] = {}
        # Bodies read to their end in the background, to keep their connections.
        self._ends: dict[asyncio.Task[None], aiohttp.ClientResponse] = {}

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
        return AiohttpAnswer(response, self._read_end)

    def _read_end(self, response: aiohttp.ClientResponse) -> None:
        task = asyncio.get_running_loop().create_task(_read_end(response))
        self._ends[task] = response
        task.add_done_callback(self._ends.pop)

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
        for task, response in list(self._ends.items()):
            task.cancel()
            response.close()  # also when the task was cancelled before it began
        await asyncio.gather(*self._ends, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _read_end(response: aiohttp.ClientResponse) -> None:
    """Reads what is left of `response`'s body, then gives its connection back to the pool;
    a body that does not end within END_WAIT_S and END_BYTES closes its connection."""
    left = END_BYTES
    try:
        async with asyncio.timeout(END_WAIT_S):
            while left >= 0 and (chunk := await response.content.readany()):
                left -= len(chunk)
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass
    finally:
        if response.content.is_eof() and left >= 0:
            response.release()
        else:
            response.close()
