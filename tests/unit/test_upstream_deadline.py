"""One step's upstream call has a total deadline (`step_timeout_s`, or the caller's `deadline`),
which holds however slowly the upstream's bytes trickle in."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from proxy.engine.values import ModelRequest
from proxy.errors import CallDeadlineReached, UpstreamStatusError, UpstreamTimeout
from proxy.upstream.client import Upstream
from proxy.upstream.httpx_transport import HttpxTransport

# A bound that holds fails in about a second; one that does not hangs until this.
HANG_S = 20


class Dripping(httpx.AsyncByteStream):
    """An SSE body that never ends: a comment byte every 10 ms."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0.01)
            yield b":"


class Attempts(list[tuple[str, str]]):
    def __call__(self, upstream: str, status_class: str) -> None:
        self.append((upstream, status_class))


def dripping(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Dripping())


async def silent(request: httpx.Request) -> httpx.Response:
    await asyncio.Event().wait()
    raise AssertionError("never answers")


def request(stream: bool = True) -> ModelRequest:
    return ModelRequest("m", [{"role": "user", "content": "hi"}], [], stream=stream)


def upstream(handler: object, **fields: object) -> Upstream:
    transport = httpx.MockTransport(handler)  # type: ignore[arg-type]
    return Upstream("up", "http://up.test/v1", HttpxTransport(transport), **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [True, False])
async def test_the_step_timeout_fires_while_bytes_trickle_in(stream: bool) -> None:
    up = upstream(dripping, step_timeout_s=0.5, timeout_s=5.0)
    async with asyncio.timeout(HANG_S):
        with pytest.raises(UpstreamTimeout) as raised:
            await up.complete(request(stream), None)
    assert type(raised.value) is UpstreamTimeout
    assert raised.value.message == "upstream up did not finish within 0.5 s"
    assert (raised.value.status, raised.value.code) == (504, "upstream_timeout")


async def test_the_callers_deadline_ends_the_call_when_it_comes_first() -> None:
    up = upstream(dripping, step_timeout_s=60.0)
    async with asyncio.timeout(HANG_S):
        with pytest.raises(CallDeadlineReached):
            await up.complete(request(), None, deadline=time.monotonic() + 0.3)


async def test_the_step_timeout_holds_when_the_callers_deadline_is_later() -> None:
    up = upstream(dripping, step_timeout_s=0.3)
    async with asyncio.timeout(HANG_S):
        with pytest.raises(UpstreamTimeout) as raised:
            await up.complete(request(), None, deadline=time.monotonic() + 60)
    assert not isinstance(raised.value, CallDeadlineReached)


async def test_an_attempt_that_never_got_an_answer_is_counted_as_a_timeout() -> None:
    attempts = Attempts()
    up = upstream(silent, step_timeout_s=0.3, on_attempt=attempts)
    async with asyncio.timeout(HANG_S):
        with pytest.raises(UpstreamTimeout):
            await up.complete(request(), None)
    assert attempts == [("up", "timeout")]


@pytest.mark.parametrize("stream", [True, False])
async def test_an_answer_cut_by_the_step_timeout_is_counted_as_a_timeout(stream: bool) -> None:
    attempts = Attempts()
    up = upstream(dripping, step_timeout_s=0.3, timeout_s=5.0, on_attempt=attempts)
    async with asyncio.timeout(HANG_S):
        with pytest.raises(UpstreamTimeout):
            await up.complete(request(stream), None)
    assert attempts == [("up", "timeout")]


async def test_a_whole_answer_is_counted_as_its_status() -> None:
    message = {"role": "assistant", "content": "hi"}
    body = orjson.dumps({"choices": [{"message": message, "finish_reason": "stop"}]})
    attempts = Attempts()
    up = upstream(lambda request: httpx.Response(200, content=body), on_attempt=attempts)
    reply = await up.complete(request(False), None)
    assert reply.text == "hi"
    assert attempts == [("up", "2xx")]


async def test_no_retry_waits_past_the_deadline() -> None:
    def busy(request: httpx.Request) -> httpx.Response:
        body = b'{"error": {"message": "busy", "type": "server_error"}}'
        return httpx.Response(503, headers={"retry-after": "5"}, stream=httpx.ByteStream(body))

    attempts = Attempts()
    up = upstream(busy, max_retries=3, on_attempt=attempts)
    started = time.monotonic()
    with pytest.raises(UpstreamStatusError) as raised:
        await up.complete(request(False), None, deadline=time.monotonic() + 1.0)
    assert (raised.value.status, raised.value.message) == (503, "busy")
    assert attempts == [("up", "5xx")]
    assert time.monotonic() - started < 4  # did not sleep the 5 s it was asked to
