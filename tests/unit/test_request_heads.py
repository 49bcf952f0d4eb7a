"""What one connection may make the server hold (`proxy.api.guarded_protocol`): a
request's line and headers (MAX_HEAD_BYTES, however the reads they come in are cut), its
trailers, the rest of a request answered early, the requests pipelined behind one. The server's
protocol is fed exact reads, as the event loop would."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.server import ServerState

from proxy.api.guarded_protocol import (
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_PIPELINED,
    guarded_protocol,
)


async def ok(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers once the body came; at once at /early, as /healthz does."""
    while scope["path"] != "/early" and (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


class Recorded(asyncio.Transport):
    """A client connection that keeps what the server writes."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closed:  # as a real connection, closed, drops what is written
            self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8080)}.get(name)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


async def answers(reads: list[bytes]) -> list[bytes]:
    """The status lines the server writes for `reads`, fed one at a time."""
    written = await exchange(reads)
    return [line for line in written.split(b"\r\n") if line.startswith(b"HTTP/1.1")]


async def exchange(reads: list[bytes]) -> bytes:
    """What the server writes for `reads`, fed one at a time."""
    served = Served()
    await served.send(*reads)
    served.close()
    return served.transport.written


class Served:
    """One client's connection to the server: the reads it sends, the requests the app got."""

    def __init__(self, header_timeout_s: float = 10) -> None:
        self.requests: list[Scope] = []

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            self.requests.append(scope)
            await ok(scope, receive, send)

        config = uvicorn.Config(app, log_level="warning")
        config.load()
        protocol = guarded_protocol(100, header_timeout_s)
        self.protocol: Any = protocol(config=config, server_state=ServerState(), app_state={})
        self.transport = Recorded()
        self.protocol.connection_made(self.transport)

    async def send(self, *reads: bytes) -> None:
        for data in reads:
            if self.transport.closed:
                break
            self.protocol.data_received(data)
            await asyncio.sleep(0.01)  # the app answers

    def close(self) -> None:
        self.protocol.connection_lost(None)


def get(pad: int) -> bytes:
    return b"GET /x HTTP/1.1\r\nhost: proxy\r\nx-pad: %s\r\n\r\n" % (b"a" * pad)


TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large"


async def test_a_long_head_is_refused_whether_it_comes_in_one_read_or_many() -> None:
    long = get(MAX_HEAD_BYTES + 100)
    assert await answers([long]) == [TOO_LARGE]
    assert await answers([long[:-4], long[-4:]]) == [TOO_LARGE]  # completed by a second read
    pieces = [long[i : i + 1024] for i in range(0, len(long), 1024)]
    assert await answers(pieces) == [TOO_LARGE]


async def test_a_head_of_more_fields_than_the_bound_is_refused() -> None:
    """6,000 one-byte headers fit in 64 KiB: 100 such requests held the loop 245 ms."""

    def with_fields(n: int) -> bytes:
        fields = b"".join(b"x-%d: a\r\n" % i for i in range(n - 1))
        return b"GET /x HTTP/1.1\r\nhost: proxy\r\n" + fields + b"\r\n"

    assert await answers([with_fields(MAX_HEADERS)]) == [b"HTTP/1.1 200 OK"]
    written = await exchange([with_fields(MAX_HEADERS + 1)])
    assert written.startswith(TOO_LARGE)
    assert f"more than {MAX_HEADERS} header fields".encode() in written


async def test_a_head_under_the_bound_is_served_in_one_read() -> None:
    assert await answers([get(MAX_HEAD_BYTES - 200)]) == [b"HTTP/1.1 200 OK"]


async def test_a_head_begun_in_the_read_that_ends_a_long_body_is_served() -> None:
    body = b"x" * 200_000
    post = b"POST /x HTTP/1.1\r\nhost: proxy\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    both = post + get(10)
    cut = len(both) - len(get(10)) + 10  # the body's end and the next head's start: one read
    assert await answers([both[:1000], both[1000:cut], both[cut:]]) == [b"HTTP/1.1 200 OK"] * 2


@pytest.mark.parametrize(
    "head",
    [
        b"POST /x HTTP/1.1\r\nhost: proxy\r\ncontent-length: -5\r\n\r\n",
        b"POST /x HTTP/1.1\r\nhost: proxy\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"GET /x HTTP/1.1\r\nhost proxy\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # TLS spoken to a plain port
    ],
)
async def test_a_request_that_is_not_http_gets_an_openai_shaped_400(head: bytes) -> None:
    written = await exchange([head])
    status, body = written.split(b"\r\n\r\n", 1)
    assert status.startswith(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json")
    assert orjson.loads(body)["error"] == {
        "message": "the request is not valid HTTP/1.1: its line, headers or body framing",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


@pytest.mark.parametrize(
    ("method", "upgrade"), [("POST", b"websocket"), ("GET", b"websocket"), ("POST", b"h2c")]
)
async def test_a_request_asking_for_another_protocol_is_answered_400_and_closed(
    method: str, upgrade: bytes
) -> None:
    body = b'{"model":"m"}'
    request = method.encode() + b" /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\n"
    request += b"connection: Upgrade\r\nupgrade: %s\r\nsec-websocket-key: " % upgrade
    request += b"dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
    request += b"content-length: %d\r\n\r\n" % len(body) + body
    written = await exchange([request])
    status, answer = written.split(b"\r\n\r\n", 1)
    assert status.startswith(b"HTTP/1.1 400 Bad Request")
    assert b"connection: close" in status
    assert orjson.loads(answer)["error"]["message"].startswith(
        "the proxy speaks HTTP/1.1 only and upgrades no connection"
    )


CHUNKED = b"POST /x HTTP/1.1\r\nhost: proxy\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"


async def test_trailers_are_no_headers_of_the_request_and_are_bounded() -> None:
    served = Served()
    await served.send(CHUNKED + b"0\r\nx-sum: 5\r\n\r\n")
    assert served.transport.written.startswith(b"HTTP/1.1 200 OK")
    (request,) = served.requests
    assert (b"x-sum", b"5") not in request["headers"]
    trailer = b"x-t: " + b"v" * 1000 + b"\r\n"
    await served.send(CHUNKED + b"0\r\n", *[trailer * 16] * 8)  # 128 KiB of trailer lines
    assert served.transport.closed
    served.close()
    endless = Served()  # one trailer line that never ends: held by the parser until it does
    await endless.send(CHUNKED + b"0\r\nx-t: ", *[b"v" * 16 * 1024] * 8)
    assert endless.transport.closed
    endless.close()


async def test_the_rest_of_a_request_answered_early_has_the_header_deadline() -> None:
    served = Served(header_timeout_s=0.2)
    # answered without its body being read, which then trickles in
    await served.send(b"GET /early HTTP/1.1\r\nhost: proxy\r\ntransfer-encoding: chunked\r\n\r\n")
    assert served.transport.written.startswith(b"HTTP/1.1 200 OK")
    for _ in range(6):  # a byte of body every 0.1 s: data does not put the deadline off
        await served.send(b"1\r\nx\r\n")
        await asyncio.sleep(0.09)
    assert served.transport.closed
    served.close()


async def test_requests_pipelined_past_the_bound_are_answered_up_to_it_then_closed() -> None:
    """The one being answered and MAX_PIPELINED behind it are answered; then the connection
    closes, the rest (held nowhere) unanswered."""
    served = Served()
    await served.send(b"GET /x HTTP/1.1\r\nhost: proxy\r\n\r\n" * 1000)  # one read
    for _ in range(100):
        await asyncio.sleep(0.01)
        if served.transport.closed:
            break
    assert served.transport.closed
    assert len(served.requests) == MAX_PIPELINED + 1
    assert served.transport.written.count(b"HTTP/1.1 200 OK") == MAX_PIPELINED + 1
    served.close()
    few = Served()
    await few.send(b"GET /x HTTP/1.1\r\nhost: proxy\r\n\r\n" * 8)
    await asyncio.sleep(0.1)
    assert few.transport.written.count(b"HTTP/1.1 200 OK") == 8
    assert not few.transport.closed
    few.close()


async def test_a_request_asking_for_h2c_without_a_body_is_served_and_its_connection_closed() -> (
    None
):
    """As Java's HttpClient asks by default on an http:// URL."""
    written = await exchange(
        [
            b"GET /v1/models HTTP/1.1\r\nhost: proxy\r\nconnection: Upgrade, HTTP2-Settings\r\n"
            b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQBAAAAAAIAAAAA\r\n\r\n"
        ]
    )
    status, _ = written.split(b"\r\n\r\n", 1)
    assert status.startswith(b"HTTP/1.1 200 OK")
    assert b"connection: close" in status
