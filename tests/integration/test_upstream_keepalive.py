"""Upstream connections outlive the streams they carry: a stream's `[DONE]` usually comes a
moment before the end of its body, and the connection is kept by reading that end out of the
run's way (a new connection per streamed step would cost a TLS handshake each against a real
provider). A body that does not end is closed within a bound; a client that goes away closes
its upstream connection at once. The proxy talks to a real server over its default transport."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.types import ASGIApp, Message

from proxy.api.app import create_app, tools_transport
from proxy.config import parse_config
from proxy.tools.base import TOOL_KEEPALIVE_S
from proxy.upstream.http1_connection import END_WAIT_S, Answer, Broken
from proxy.upstream.http1_transport import CROSSED_S, Http1Transport
from proxy.upstream.transport import Timeouts
from tests.faulty_upstream import DONE, completion, delta, listening, read_request, reset_now

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
TIMEOUTS = Timeouts(connect_s=5, read_s=5)
CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


class KeptAliveUpstream:
    """Answers every request of a connection with a stream whose last chunk (the end of the
    body) waits for `end` after `[DONE]`; counts connections and sees them close."""

    def __init__(self) -> None:
        self.end = asyncio.Event()
        self.done_sent = asyncio.Event()
        self.opened = 0
        self.closed = asyncio.Queue[int]()
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        number = self.opened
        try:
            while await read_request(reader) is not None:
                self.done_sent.clear()
                writer.write(HEAD)
                for piece in (delta(""), delta("Hello", finish_reason="stop"), DONE):
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
                self.done_sent.set()
                if not await _first(self.end.wait(), reader.read(1)):
                    return  # the proxy closed the connection (read b"") before the end
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed.put_nowait(number)
            writer.close()


async def _first(*waits: Any) -> Any:
    """The result of whichever of `waits` finishes first; the others are cancelled."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return next(iter(done)).result()


@contextlib.asynccontextmanager
async def running(upstream: KeptAliveUpstream) -> AsyncIterator[ASGIApp]:
    # `upstream.serve` looked up at each connection: a test may replace it meanwhile.
    async with listening(lambda reader, writer: upstream.serve(reader, writer)) as port:
        upstream.url = f"http://127.0.0.1:{port}/v1"
        config = {
            "upstreams": {"main": {"base_url": upstream.url, "max_retries": 0}},
            "default_upstream": "main",
            "state": {"backend": "memory"},
        }
        app = create_app(parse_config(config), registry=CollectorRegistry())
        async with app.router.lifespan_context(app):
            yield app


async def stream(app: ASGIApp) -> str:
    """One streamed completion through the proxy: its text, checked whole."""
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    assert r.text.endswith("data: [DONE]\n\n")
    events = [orjson.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


async def test_a_stream_whose_body_ends_after_done_keeps_its_upstream_connection() -> None:
    upstream = KeptAliveUpstream()
    async with running(upstream) as app:
        for _ in range(3):
            upstream.end.clear()
            async with asyncio.timeout(10):
                # The client has the whole answer while the body's end is still held back.
                assert await stream(app) == "Hello"
            upstream.end.set()
            await asyncio.sleep(0.2)  # the end reaches the proxy, which reads it at once
        assert upstream.opened == 1
        assert upstream.closed.empty()


async def test_a_body_that_does_not_end_after_done_is_closed_within_the_bound() -> None:
    upstream = KeptAliveUpstream()  # `end` never set: the body never ends
    async with running(upstream) as app:
        async with asyncio.timeout(10):
            assert await stream(app) == "Hello"
        async with asyncio.timeout(END_WAIT_S + 5):
            assert await upstream.closed.get() == 1
        async with asyncio.timeout(10):
            assert await stream(app) == "Hello"
        assert upstream.opened == 2


async def test_a_client_that_goes_away_closes_its_upstream_connection_at_once() -> None:
    upstream = KeptAliveUpstream()
    gone = asyncio.Event()
    body = orjson.dumps(CHAT)
    received: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        if received:
            return received.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        return None

    async with running(upstream) as app:
        upstream.done_sent.clear()
        # Held before `[DONE]`: the stream is cut while the run still reads it.
        held = asyncio.Event()
        original = upstream.serve

        async def before_done(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            upstream.opened += 1
            try:
                await read_request(reader)
                writer.write(HEAD + b"%x\r\n%s\r\n" % (len(delta("")), delta("")))
                await writer.drain()
                held.set()
                await reader.read()  # until the proxy closes the connection
            finally:
                upstream.closed.put_nowait(upstream.opened)
                writer.close()

        upstream.serve = before_done  # type: ignore[method-assign]
        request = asyncio.create_task(app(scope(), receive, send))
        async with asyncio.timeout(10):
            await held.wait()
        gone.set()
        async with asyncio.timeout(END_WAIT_S / 2):  # not read on: closed at once
            assert await upstream.closed.get() == 1
        async with asyncio.timeout(10):
            await request
        upstream.serve = original  # type: ignore[method-assign]


def scope() -> dict[str, Any]:
    return {
        "type": "http", "method": "POST", "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
        "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
    }  # fmt: skip


async def test_the_transport_keeps_a_connection_whose_caller_read_up_to_done() -> None:
    """The port's contract, on the aiohttp transport itself: `keep_alive` then `aclose` (twice:
    closing is idempotent) keeps the connection for the next request."""
    upstream = KeptAliveUpstream()
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    transport = Http1Transport()
    timeouts = Timeouts(connect_s=5, read_s=5)
    try:
        for _ in range(2):
            upstream.end.clear()  # the end comes after the caller closed the answer
            answer = await transport.send("POST", url, {}, orjson.dumps(CHAT), timeouts)
            read = b""
            async for chunk in answer.chunks():
                read += chunk
                if DONE in read:
                    break
            answer.keep_alive()
            await answer.aclose()
            await answer.aclose()
            upstream.end.set()
            await asyncio.sleep(0.2)  # the end is read in the background
        assert upstream.opened == 1
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


class ClosingOnReuse:
    """Answers the first request of each connection, kept alive, and meets the next one with
    the connection's end and no word: at once with a FIN (`close`) or a reset (`reset`), as an
    upstream whose idle timeout fires as the proxy reuses the connection; after working on it
    past CROSSED_S (`late`); or when the proxy closes it (`hold`)."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.opened = 0
        self.requests = 0
        self.holding = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        answered = 0
        try:
            while await read_request(reader) is not None:
                self.requests += 1
                if answered:
                    if self.how == "reset":
                        reset_now(writer)
                    elif self.how == "late":
                        await asyncio.sleep(CROSSED_S + 0.3)
                    elif self.how == "hold":
                        self.holding.set()
                        await reader.read()
                    return
                body = orjson.dumps(completion("Hi."))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
                writer.write(b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                answered += 1
        finally:
            writer.close()


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_a_request_a_reused_connection_dropped_unanswered_goes_again_on_a_new_one(
    how: str,
) -> None:
    upstream = ClosingOnReuse(how)
    async with listening(upstream.serve) as port:
        app = proxy_app(f"http://127.0.0.1:{port}/v1")  # max_retries 0: no retry of ours
        async with app.router.lifespan_context(app), client_of(app) as client:
            for _ in range(3):
                r = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == "Hi."
    # Each reused connection took the next request and dropped it; each went again once.
    assert (upstream.opened, upstream.requests) == (3, 5)


async def test_a_request_dropped_after_the_upstream_worked_on_it_is_sent_once() -> None:
    """A reused connection that ends unanswered well after the request went out: the upstream
    may have taken it (and failed), so it is not sent again."""
    upstream = ClosingOnReuse("late")
    async with listening(upstream.serve) as port:
        app = proxy_app(f"http://127.0.0.1:{port}/v1")
        async with app.router.lifespan_context(app), client_of(app) as client:
            first = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
            second = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
    assert (first.status_code, second.status_code) == (200, 502)
    assert (upstream.opened, upstream.requests) == (1, 2)


async def test_a_new_connection_dropped_unanswered_is_an_upstream_error_sent_once() -> None:
    """The upstream may have taken a request a connection it had not been idle on dropped."""
    seen = 0

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        if await read_request(reader) is not None:
            seen += 1
        writer.close()

    async with listening(drop) as port:
        app = proxy_app(f"http://127.0.0.1:{port}/v1")
        async with app.router.lifespan_context(app), client_of(app) as client:
            r = await client.post("/v1/chat/completions", json={**CHAT, "stream": False})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unavailable"
    assert seen == 1


@contextlib.asynccontextmanager
async def transport_to(upstream: ClosingOnReuse) -> AsyncIterator[tuple[Http1Transport, str]]:
    async with listening(upstream.serve) as port:
        transport = Http1Transport()
        try:
            yield transport, f"http://127.0.0.1:{port}/v1/chat/completions"
        finally:
            await transport.aclose()


async def whole(answer: Answer) -> bytes:
    read = b"".join([chunk async for chunk in answer.chunks()])
    await answer.aclose()
    return read


async def streamed() -> AsyncIterator[bytes]:
    yield orjson.dumps(CHAT)


@pytest.mark.parametrize(
    ("method", "body", "again"),
    [
        ("POST", "bytes", True),  # the upstream calls of runs
        ("GET", None, True),
        ("POST", None, False),  # relayed: sent once
        ("POST", "streamed", False),
    ],
)
async def test_which_requests_go_again(method: str, body: str | None, again: bool) -> None:
    upstream = ClosingOnReuse("close")

    def made() -> bytes | AsyncIterator[bytes] | None:
        return orjson.dumps(CHAT) if body == "bytes" else streamed() if body else None

    async with transport_to(upstream) as (transport, url):
        assert b"Hi." in await whole(await transport.send(method, url, {}, made(), TIMEOUTS))
        if again:
            assert b"Hi." in await whole(await transport.send(method, url, {}, made(), TIMEOUTS))
        else:
            with pytest.raises(Broken):
                await transport.send(method, url, {}, made(), TIMEOUTS)
    assert (upstream.opened, upstream.requests) == ((2, 3) if again else (1, 2))


async def test_a_request_goes_again_on_a_new_connection_not_another_idle_one() -> None:
    upstream = ClosingOnReuse("close")  # every kept connection drops its next request
    body = orjson.dumps(CHAT)
    async with transport_to(upstream) as (transport, url):
        firsts = [transport.send("POST", url, {}, body, TIMEOUTS) for _ in range(2)]
        for answer in await asyncio.gather(*firsts):
            await whole(answer)
        assert upstream.opened == 2  # both kept, both about to drop what comes
        assert b"Hi." in await whole(await transport.send("POST", url, {}, body, TIMEOUTS))
    assert (upstream.opened, upstream.requests) == (3, 4)


async def test_a_request_the_proxy_cut_by_closing_its_transport_is_not_sent_again() -> None:
    upstream = ClosingOnReuse("hold")
    body = orjson.dumps(CHAT)
    async with transport_to(upstream) as (transport, url):
        await whole(await transport.send("POST", url, {}, body, TIMEOUTS))
        held = asyncio.create_task(transport.send("POST", url, {}, body, TIMEOUTS))
        async with asyncio.timeout(10):
            await upstream.holding.wait()
        await transport.aclose()
        with pytest.raises(Broken):
            await held
    assert (upstream.opened, upstream.requests) == (1, 2)


def proxy_app(url: str) -> Starlette:
    config = {
        "upstreams": {"main": {"base_url": url, "max_retries": 0}},
        "default_upstream": "main",
        "state": {"backend": "memory"},
    }
    return create_app(parse_config(config), registry=CollectorRegistry())


def client_of(app: ASGIApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy")


async def test_the_tools_pool_lets_go_of_a_connection_before_its_server_would() -> None:
    """A tool server that closes connections idle for 2 s (gunicorn's threaded and async
    workers; uvicorn and Node wait 5 s), whose close crosses the next call: the pool has opened
    another by then."""
    idle_close_s = 2.0
    assert idle_close_s > TOOL_KEEPALIVE_S
    opened = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal opened
        opened += 1
        answered_at = None
        try:
            while await read_request(reader) is not None:
                if answered_at is not None and time.monotonic() - answered_at >= idle_close_s:
                    return  # its idle timer fired as the request came: no answer
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
                answered_at = time.monotonic()
        finally:
            writer.close()

    async with (
        listening(serve) as port,
        httpx.AsyncClient(transport=tools_transport(8)) as client,
    ):
        url = f"http://127.0.0.1:{port}/tool"
        assert (await client.post(url, json={})).text == "ok"
        await asyncio.sleep(idle_close_s + 0.1)
        assert (await client.post(url, json={})).text == "ok"
    assert opened == 2
