"""Any httpx transport as the upstreams' transport: an in-process app, respx, a test's
scripted upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from proxy.upstream.transport import Answer, Body, Failure, Headers, Timeouts


class HttpxAnswer:
    __slots__ = ("_response",)

    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    @property
    def status(self) -> int:
        return self._response.status_code

    def header(self, name: str) -> str | None:
        value: str | None = self._response.headers.get(name)
        return value

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return list(self._response.headers.raw)

    def chunks(self) -> AsyncIterator[bytes]:
        try:
            content = self._response.content  # a response made with its body already read
        except httpx.ResponseNotRead:
            return self._response.aiter_raw()
        return _once(content)

    def keep_alive(self) -> None:
        """Not done here: httpx closes a connection whose body was not read to its end."""

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpxTransport:
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def send(
        self, method: str, url: str, headers: Headers, body: Body, timeouts: Timeouts
    ) -> Answer:
        timeout = httpx.Timeout(timeouts.read_s, connect=timeouts.connect_s).as_dict()
        request = httpx.Request(
            method, url, content=body, headers=headers, extensions={"timeout": timeout}
        )
        return HttpxAnswer(await self.inner.handle_async_request(request))

    def failure(self, exc: BaseException) -> Failure | None:
        if isinstance(exc, httpx.ConnectTimeout):
            return Failure.CONNECT_TIMEOUT
        if isinstance(exc, httpx.ConnectError):
            return Failure.UNREACHABLE
        if isinstance(exc, httpx.TimeoutException):
            return Failure.TIMEOUT
        if isinstance(exc, httpx.HTTPError):
            return Failure.BROKEN
        return None

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _once(content: bytes) -> AsyncIterator[bytes]:
    yield content
