"""The upstreams' HTTP/1.1 transport against real servers on 127.0.0.1: what it sends, how it
reads every way an answer can be delimited, which connections it keeps, and what each kind of
failure means for the call."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable

import pytest
import trustme

from proxy.egress import Egress, WebProxy
from proxy.upstream.http1_connection import (
    END_BYTES,
    HIGH_WATER,
    MAX_FIELDS,
    ConnectTimeout,
    Unreachable,
)
from proxy.upstream.http1_transport import Http1Transport
from proxy.upstream.transport import Answer, Failure, Timeouts
from tests.faulty_upstream import Handle, Received, listening, read_request
from tests.web_proxy import UPSTREAM_HOST, forward_proxy

TIMEOUTS = Timeouts(connect_s=5.0, read_s=5.0)


def ok(body: bytes = b"{}", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


class Server:
    """Serves each connection with `handler`; counts the connections and sees them close."""

    def __init__(self, handler: Handle) -> None:
        self.handler = handler
        self.opened = 0
        self.closed = 0
        self.requests: list[Received] = []
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed += 1
            writer.close()


@contextlib.asynccontextmanager
async def serving(
    handler: Handle | None = None, tls: ssl.SSLContext | None = None
) -> AsyncIterator[Server]:
    server = Server(handler or (lambda r, w: asyncio.sleep(0)))
    async with listening(server.serve, tls) as port:
        server.url = f"{'https' if tls else 'http'}://{'localhost' if tls else '127.0.0.1'}:{port}"
        yield server


def keep_answering(server_answers: list[bytes]) -> Callable[[Server], Handle]:
    """A handler that answers each request of a connection with the next of `server_answers`."""

    def bind(server: Server) -> Handle:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while server_answers and (received := await read_request(reader)) is not None:
                server.requests.append(received)
                writer.write(server_answers.pop(0))
                await writer.drain()
            await reader.read()  # until the client closes

        return handle

    return bind


@contextlib.asynccontextmanager
async def upstream(*answers: bytes) -> AsyncIterator[Server]:
    async with serving() as server:
        server.handler = keep_answering(list(answers))(server)
        yield server


async def body_of(answer: Answer) -> bytes:
    try:
        return b"".join([chunk async for chunk in answer.chunks()])
    finally:
        await answer.aclose()


async def get(transport: Http1Transport, url: str) -> bytes:
    """The body of a GET of `url`, whole."""
    return await body_of(await transport.send("GET", url, {}, None, TIMEOUTS))


async def eventually(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never came true")


async def test_requests_go_as_written_and_answers_come_whole_on_one_kept_connection() -> None:
    async with upstream(ok(b'{"a":1}', b"x-first: 1\r\nX-First: 2\r\n"), ok(b"second")) as server:
        transport = Http1Transport()
        headers = {"content-type": "application/json", "authorization": "Bearer k"}
        first = await transport.send(
            "POST", f"{server.url}/v1/chat?x=%2F", headers, b'{"m":1}', TIMEOUTS
        )
        assert first.status == 200
        assert first.header("X-FIRST") == "1"  # any case; the first when it came twice
        assert (b"X-First", b"2") in first.raw_headers()  # names as they came
        assert await body_of(first) == b'{"a":1}'
        second = await transport.send("GET", f"{server.url}/v1/models", [], None, TIMEOUTS)
        assert await body_of(second) == b"second"
        await transport.aclose()
    assert server.opened == 1
    post, get = server.requests
    assert (post.method, post.path, post.body) == ("POST", "/v1/chat?x=%2F", b'{"m":1}')
    assert post.headers == {
        "host": server.url.removeprefix("http://"),
        "content-type": "application/json",
        "authorization": "Bearer k",
        "content-length": "7",
    }
    assert (get.method, get.path, get.headers.get("content-length")) == ("GET", "/v1/models", None)


async def test_a_streamed_body_goes_chunked() -> None:
    async def parts() -> AsyncIterator[bytes]:
        for part in (b"one ", b"", b"two"):
            yield part

    async with upstream(ok()) as server:
        transport = Http1Transport()
        answer = await transport.send("POST", server.url, {}, parts(), TIMEOUTS)
        await body_of(answer)
        await transport.aclose()
    assert server.requests[0].body == b"one two"
    assert server.requests[0].headers["transfer-encoding"] == "chunked"


async def test_chunked_answers_and_interim_ones_are_read_and_the_connection_kept() -> None:
    chunked = (
        b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    async with upstream(chunked, b"HTTP/1.1 204 No Content\r\n\r\n", ok(b"x")) as server:
        transport = Http1Transport()
        answer = await transport.send("GET", server.url, {}, None, TIMEOUTS)
        assert (answer.status, answer.header("link")) == (200, None)
        assert await body_of(answer) == b"hello world"
        empty = await transport.send("GET", server.url, {}, None, TIMEOUTS)
        assert (empty.status, await body_of(empty)) == (204, b"")
        assert await get(transport, server.url) == b"x"
        await transport.aclose()
    assert server.opened == 1


async def test_an_answer_that_no_request_asked_for_closes_the_connection() -> None:
    async with upstream(ok(b"one") + ok(b"extra"), ok(b"two")) as server:
        transport = Http1Transport()
        assert await get(transport, server.url) == (b"one")
        await eventually(lambda: server.closed == 1)
        assert await get(transport, server.url) == (b"two")
        await transport.aclose()
    assert server.opened == 2


async def test_a_body_delimited_by_the_connections_end_is_whole_and_not_kept() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        await writer.drain()

    async with serving(handle) as server:
        transport = Http1Transport()
        assert await get(transport, server.url) == (b"all of it")
        assert await get(transport, server.url) == (b"all of it")
        await transport.aclose()
    assert server.opened == 2


async def test_an_answer_closed_before_its_end_closes_its_connection() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf ")
            await writer.drain()

    async with serving(handle) as server:
        transport = Http1Transport()
        for _ in range(2):
            answer = await transport.send("GET", server.url, {}, None, TIMEOUTS)
            assert await anext(answer.chunks()) == b"half "
            await answer.aclose()
        await eventually(lambda: server.closed == 2)
        await transport.aclose()
    assert server.opened == 2


async def test_a_body_end_left_to_read_is_read_within_its_bound_or_the_connection_closed() -> None:
    small_end = b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nneeded"  # + b"!!" later
    big_end = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\nneeded" % (END_BYTES + 100)
    sent: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for head, end in ((small_end, b"!!"), (big_end, b"x" * (END_BYTES + 94))):
            if await read_request(reader) is None:
                return
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.05)  # the caller closes its answer before the end comes
            writer.write(end)
            await writer.drain()
            sent.append(len(end))
        await reader.read()

    async with serving(handle) as server:
        transport = Http1Transport()
        for number in (1, 2):
            answer = await transport.send("GET", server.url, {}, None, TIMEOUTS)
            assert await anext(answer.chunks()) == b"needed"
            answer.keep_alive()
            await answer.aclose()
            await eventually(lambda: len(sent) == number)  # noqa: B023
            await asyncio.sleep(0.02)  # the end reaches the client
        assert server.closed == 1  # the big end closed it
        await transport.aclose()
    assert server.opened == 1  # the small end was read and the connection kept for the next


async def test_a_slow_reader_holds_a_bounded_part_of_a_large_body() -> None:
    size = 8 * 1024 * 1024

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()

    async with serving(handle) as server:
        transport = Http1Transport()
        answer = await transport.send("GET", server.url, {}, None, TIMEOUTS)
        pieces = []
        async for chunk in answer.chunks():
            pieces.append(len(chunk))
            await asyncio.sleep(0.002)  # reads slower than the server sends
        await answer.aclose()
        await transport.aclose()
    assert sum(pieces) == size
    assert max(pieces) <= 2 * HIGH_WATER  # without the pause, one piece would be most of it


async def test_one_connection_at_most_makes_the_next_request_wait_and_reuse_it() -> None:
    async with upstream(ok(b"1"), ok(b"2")) as server:
        transport = Http1Transport(connections=1)
        first = await transport.send("GET", server.url, {}, None, TIMEOUTS)
        second = asyncio.ensure_future(transport.send("GET", server.url, {}, None, TIMEOUTS))
        await asyncio.sleep(0.05)
        assert not second.done()  # waiting for the one connection
        assert await body_of(first) == b"1"
        assert await body_of(await second) == b"2"
        await transport.aclose()
    assert server.opened == 1


async def test_at_the_limit_an_idle_connection_elsewhere_is_closed_to_open_one() -> None:
    async with upstream(ok(b"a")) as one, upstream(ok(b"b")) as other:
        transport = Http1Transport(connections=1)
        assert await get(transport, one.url) == b"a"
        assert await get(transport, other.url) == b"b"
        await eventually(lambda: one.closed == 1)
        await transport.aclose()


async def test_idle_connections_are_closed_after_the_keepalive() -> None:
    async with upstream(ok(), ok()) as server:
        transport = Http1Transport(keepalive_s=0.1)
        await get(transport, server.url)
        await asyncio.sleep(0.02)
        assert server.closed == 0
        await eventually(lambda: server.closed == 1)
        await get(transport, server.url)
        await transport.aclose()
    assert server.opened == 2


async def test_a_connection_the_upstream_closed_while_idle_is_not_used_again() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok(b"once"))
        await writer.drain()  # then closes, though the answer said nothing of it

    async with serving(handle) as server:
        transport = Http1Transport()
        assert await get(transport, server.url) == (b"once")
        await eventually(lambda: server.closed == 1)
        await asyncio.sleep(0.02)  # the close reaches the client
        assert await get(transport, server.url) == (b"once")
        await transport.aclose()
    assert server.opened == 2


async def test_https_upstreams_are_verified_against_the_trusted_authorities(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    authority = trustme.CA()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("localhost").configure_cert(tls)
    async with serving(tls=tls) as server:
        server.handler = keep_answering([ok(b"secure")])(server)
        untrusting = Http1Transport()
        with pytest.raises(Unreachable) as refused:
            await untrusting.send("GET", server.url, {}, None, TIMEOUTS)
        assert untrusting.failure(refused.value) is Failure.UNREACHABLE
        assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
        with authority.cert_pem.tempfile() as ca_file:
            monkeypatch.setenv("SSL_CERT_FILE", ca_file)
            trusting = Http1Transport()
            answer = await trusting.send("GET", f"{server.url}/v1", {}, None, TIMEOUTS)
        assert await body_of(answer) == b"secure"
        await trusting.aclose()
        await untrusting.aclose()


def sends(data: bytes, then_closes: bool = False) -> Handle:
    """A handler that reads a request, sends `data`, then keeps the connection open until the
    client closes it (or closes it at once)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(data)
        await writer.drain()
        if not then_closes:
            await reader.read()

    return handle


async def test_what_each_failure_means() -> None:
    half = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf "
    silent = sends(b"")
    stalls_mid_body = sends(half)
    cut_mid_body = sends(half, then_closes=True)
    not_http = sends(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
    header_flood = sends(b"HTTP/1.1 200 OK\r\n" + b"x-a: b\r\n" * (MAX_FIELDS + 1) + b"\r\n")
    switches = sends(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n")
    closes_at_once = sends(b"", then_closes=True)

    quick = Timeouts(connect_s=5.0, read_s=0.1)
    transport = Http1Transport()

    async def failure_of(handler: Handle, read_body: bool = False) -> tuple[Failure | None, str]:
        async with serving(handler) as server:
            try:
                answer = await transport.send("GET", server.url, {}, None, quick)
                if read_body:
                    await body_of(answer)
            except Exception as exc:
                await eventually(lambda: server.closed == 1)  # the connection is not kept
                return transport.failure(exc), str(exc)
        raise AssertionError("no failure")

    assert await failure_of(silent) == (Failure.TIMEOUT, "no byte from the upstream within 0.1 s")
    assert (await failure_of(stalls_mid_body, read_body=True))[0] is Failure.TIMEOUT
    broken, said = await failure_of(cut_mid_body, read_body=True)
    assert (broken, said) == (
        Failure.BROKEN,
        "the upstream closed the connection before its answer was whole",
    )
    not_http_failure, said = await failure_of(not_http)
    assert not_http_failure is Failure.NOT_HTTP  # a bad reply: not worth another attempt
    assert said
    flood, said = await failure_of(header_flood)
    assert flood is Failure.NOT_HTTP
    assert f"over {MAX_FIELDS} header fields" in said
    assert await failure_of(switches) == (Failure.NOT_HTTP, "the upstream switched protocols")
    assert (await failure_of(closes_at_once))[0] is Failure.BROKEN

    async with serving() as server:
        closed_port = server.url
    with pytest.raises(Unreachable) as refused:
        await transport.send("GET", closed_port, {}, None, TIMEOUTS)
    assert transport.failure(refused.value) is Failure.UNREACHABLE
    async with upstream(ok()) as server:
        with pytest.raises(ConnectTimeout) as slow:
            await transport.send("GET", server.url, {}, None, Timeouts(connect_s=0, read_s=1))
        assert transport.failure(slow.value) is Failure.CONNECT_TIMEOUT
    assert transport.failure(ValueError("the caller's own")) is None
    await transport.aclose()


async def test_a_request_cancelled_while_waiting_closes_its_connection_and_frees_its_place() -> (
    None
):
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    patient = Timeouts(connect_s=5.0, read_s=60.0)  # (cancelled first, on a busy host too)
    async with serving(silent) as server:
        transport = Http1Transport(connections=1)
        waiting = asyncio.ensure_future(transport.send("GET", server.url, {}, None, patient))
        await eventually(lambda: server.opened == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await eventually(lambda: server.closed == 1)
        waiting = asyncio.ensure_future(transport.send("GET", server.url, {}, None, patient))
        await eventually(lambda: server.opened == 2)  # the one place is free again
        waiting.cancel()
        await transport.aclose()


@pytest.mark.parametrize(
    ("url", "headers"),
    [
        ("http://127.0.0.1:1/v1/a b", {}),
        ("http://127.0.0.1:1/v1/a\r\nx-injected: 1", {}),
        ("ftp://127.0.0.1:1/v1", {}),
        ("http://127.0.0.1:1/v1", {"x-a": "1\r\nx-injected: 1"}),
        ("http://127.0.0.1:1/v1", {"x a": "1"}),
    ],
)
async def test_a_url_or_header_that_would_split_the_request_is_refused_before_sending(
    url: str, headers: dict[str, str]
) -> None:
    transport = Http1Transport()
    with pytest.raises(ValueError, match=r"URL|header"):
        await transport.send("GET", url, headers, None, TIMEOUTS)
    await transport.aclose()


@pytest.fixture
def no_web_proxy(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An environment that names no web proxy but those a test sets."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


async def test_https_upstreams_are_reached_through_the_environment_s_proxy(
    no_web_proxy: pytest.MonkeyPatch,
) -> None:
    """A company's egress proxy: a `CONNECT` tunnel (with the URL's user and password) to a
    host only the proxy can resolve, TLS to the upstream through it, and the tunnel kept for
    the next request."""
    authority = trustme.CA()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert(UPSTREAM_HOST).configure_cert(tls)
    async with serving(tls=tls) as server, forward_proxy() as web:
        server.handler = keep_answering([ok(b"one"), ok(b"two")])(server)
        port = server.url.rsplit(":", 1)[1]
        no_web_proxy.setenv("HTTPS_PROXY", web.url.replace("http://", "http://me:s%40cret@"))
        with authority.cert_pem.tempfile() as ca_file:
            no_web_proxy.setenv("SSL_CERT_FILE", ca_file)
            transport = Http1Transport()
            url = f"https://{UPSTREAM_HOST}:{port}/v1/models"
            assert await get(transport, url) == b"one"
            assert await get(transport, url) == b"two"
        await transport.aclose()
    assert web.lines == [f"CONNECT {UPSTREAM_HOST}:{port} HTTP/1.1"]
    assert web.authorizations == ["Basic bWU6c0BjcmV0"]  # me:s@cret
    assert [r.path for r in server.requests] == ["/v1/models", "/v1/models"]


async def test_http_upstreams_go_to_the_proxy_with_their_whole_url(
    no_web_proxy: pytest.MonkeyPatch,
) -> None:
    async with serving() as server, forward_proxy() as web:
        server.handler = keep_answering([ok(b"plain")])(server)
        no_web_proxy.setenv("http_proxy", web.url)
        transport = Http1Transport()
        url = server.url.replace("127.0.0.1", UPSTREAM_HOST) + "/v1/models?limit=2"
        assert await get(transport, url) == b"plain"
        await transport.aclose()
    assert web.lines == [f"GET {url} HTTP/1.1"]
    assert web.authorizations == [None]
    assert server.requests[0].headers["host"] == url.split("/")[2]


async def test_loopback_upstreams_are_reached_directly(no_web_proxy: pytest.MonkeyPatch) -> None:
    """As Go's and curl's clients do: a proxy cannot reach the proxy's own machine."""
    async with serving() as server, forward_proxy() as web:
        server.handler = keep_answering([ok(b"direct")])(server)
        no_web_proxy.setenv("HTTP_PROXY", web.url)
        transport = Http1Transport()
        assert await get(transport, server.url) == b"direct"
        await transport.aclose()
    assert web.lines == []


@pytest.mark.parametrize(
    ("no_proxy", "host", "direct"),
    [
        ("", "api.example.com", False),
        ("*", "api.example.com", True),
        ("example.com", "api.example.com", True),
        ("example.com", "example.com", True),
        ("example.com", "notexample.com", False),
        (".svc.cluster.local", "llm.ns.svc.cluster.local", True),
        ("*.svc.cluster.local", "llm.ns.svc.cluster.local", True),
        ("foo, *.svc.cluster.local ,bar", "svc.cluster.local", True),
        ("10.128.0.0/14,172.30.0.0/16", "10.129.4.2", True),
        ("10.128.0.0/14,172.30.0.0/16", "10.132.0.1", False),
        ("10.0.0.7", "10.0.0.7", True),
        ("internal.corp:8080", "internal.corp", True),
        ("[fd00::1]", "fd00::1", True),
        ("fd00::/8", "[fd12::5]", True),
        ("EXAMPLE.com", "Api.Example.COM", True),
        ("", "localhost", True),
        ("", "127.0.0.2", True),
        ("", "::1", True),
    ],
)
def test_no_proxy_names_hosts_in_the_forms_clusters_write(
    no_web_proxy: pytest.MonkeyPatch, no_proxy: str, host: str, direct: bool
) -> None:
    no_web_proxy.setenv("HTTPS_PROXY", "http://egress.corp:3128")
    no_web_proxy.setenv("NO_PROXY", no_proxy)
    chosen = Egress().proxy_for("https", host)
    assert chosen is None if direct else chosen == WebProxy("egress.corp", 3128, None)


async def test_a_tunnel_the_proxy_refuses_is_an_unreachable_upstream_named_with_its_answer(
    no_web_proxy: pytest.MonkeyPatch,
) -> None:
    refusal = b"HTTP/1.1 407 Proxy Authentication Required\r\ncontent-length: 0\r\n\r\n"
    async with forward_proxy(refusal) as web:
        no_web_proxy.setenv("HTTPS_PROXY", web.url)
        transport = Http1Transport()
        with pytest.raises(Unreachable) as refused:
            await transport.send("GET", "https://api.example.com/v1", {}, None, TIMEOUTS)
        await transport.aclose()
    assert transport.failure(refused.value) is Failure.UNREACHABLE
    assert "refused the tunnel to api.example.com:443: 'HTTP/1.1 407 Proxy Auth" in str(
        refused.value
    )


async def test_a_proxy_not_spoken_over_http_is_logged_and_not_used(
    no_web_proxy: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving() as server:
        server.handler = keep_answering([ok(b"direct")])(server)
        no_web_proxy.setenv("ALL_PROXY", "socks5://127.0.0.1:1080")
        transport = Http1Transport()
        assert await get(transport, server.url) == b"direct"
        await transport.aclose()
    assert "the http proxy 'socks5://127.0.0.1' is not an http:// proxy URL" in caplog.text


async def test_a_request_cancelled_as_its_connection_is_made_is_cancelled() -> None:
    """`asyncio.wait_for` on Python 3.11 returns the connection as if nothing happened when the
    cancel comes as it is made: the request went on, and waited out its read timeout."""
    tasks: list[asyncio.Task[object]] = []

    async def cancelling(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tasks[-1].cancel()  # as the client's connection is made
        await reader.read()

    async with serving(cancelling) as server:
        transport = Http1Transport()
        for _ in range(20):
            tasks.append(
                asyncio.ensure_future(
                    transport.send("GET", server.url, {}, None, Timeouts(5.0, 60.0))
                )
            )
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(tasks[-1], 10)
        await transport.aclose()
