"""The upstreams' bounded pool: a connection is held from the request until its answer is
closed, given back when the request fails, and a request that waits past the pool timeout fails
with 503 `upstream_pool_exhausted`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from proxy.errors import UpstreamPoolExhausted
from proxy.upstream.httpx_transport import HttpxTransport
from proxy.upstream.pool import BoundedTransport
from proxy.upstream.transport import Answer, Timeouts


class Streamed(httpx.AsyncByteStream):
    """A body that comes over the connection, as a real transport's does."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"ok"


def handler(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/refused":
        raise httpx.ConnectError("refused", request=request)
    if request.url.path == "/in-memory":
        return httpx.Response(200, content=b"ok")
    return httpx.Response(200, stream=Streamed())


def bounded() -> BoundedTransport:
    inner = HttpxTransport(httpx.MockTransport(handler))
    return BoundedTransport(inner, connections=1, pool_timeout_s=0.05)


async def send(transport: BoundedTransport, path: str = "/ok") -> Answer:
    return await transport.send("POST", f"http://up{path}", {}, None, Timeouts(1.0, 1.0))


async def test_a_connection_is_held_until_its_response_is_closed() -> None:
    transport = bounded()
    open_response = await send(transport)
    with pytest.raises(UpstreamPoolExhausted) as waited:
        await send(transport)
    assert waited.value.status == 503
    assert waited.value.code == "upstream_pool_exhausted"
    assert [chunk async for chunk in open_response.chunks()] == [b"ok"]
    await open_response.aclose()  # closed: the connection is free
    for _ in range(3):
        response = await send(transport)
        await response.aclose()
        await response.aclose()  # closing twice gives the connection back once
    held = await send(transport)
    with pytest.raises(UpstreamPoolExhausted):
        await send(transport)
    await held.aclose()


async def test_a_failed_request_gives_its_connection_back() -> None:
    transport = bounded()
    for _ in range(3):
        with pytest.raises(httpx.ConnectError):
            await send(transport, "/refused")
    response = await send(transport)
    assert response.status == 200
    await response.aclose()
