"""Relaying a request to an upstream as it is (SPEC §4, any other `/v1/...`), and `models()`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from proxy.errors import (
    ClientDisconnected,
    UpstreamBadReply,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.upstream import relay as relay_module
from proxy.upstream.client import Upstream
from proxy.upstream.form_model import MAX_PARTS, AmbiguousModel, FormModel
from proxy.upstream.httpx_transport import HttpxTransport
from proxy.upstream.relay import (
    json_model,
    relay,
    returned_headers,
    sniff_model,
    upstream_url,
)

JSON = "application/json"


class Attempts(list[tuple[str, str]]):
    def __call__(self, upstream: str, status_class: str) -> None:
        self.append((upstream, status_class))


def upstream(
    transport: httpx.AsyncBaseTransport,
    attempts: Attempts | None = None,
    *,
    api_key: str | None = "up-key",
    traced: bool = False,
) -> Upstream:
    def inject(headers: dict[str, str]) -> None:
        headers["traceparent"] = "00-proxy-trace-01"

    return Upstream(
        "up",
        "http://up.test/v1",
        HttpxTransport(transport),
        api_key=api_key,
        on_attempt=attempts,
        inject_headers=inject if traced else None,
    )


def recording(response: httpx.Response, seen: list[httpx.Request]) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        await request.aread()
        seen.append(request)
        return response

    return httpx.MockTransport(handler)


async def chunks_of(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


class Chunks(httpx.AsyncByteStream):
    """A response body in chunks; `after_first` is awaited before the rest is given."""

    def __init__(self, *chunks: bytes, after_first: asyncio.Event | None = None) -> None:
        self.chunks = chunks
        self.after_first = after_first
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        first, *rest = self.chunks
        yield first
        if self.after_first is not None:
            await self.after_first.wait()
        for chunk in rest:
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


class Failing(httpx.AsyncByteStream):
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"part"
        raise self.error


class StreamingUpstream(httpx.AsyncBaseTransport):
    """Reads the request body chunk by chunk as a connection would, and maps a failure of it to
    an httpx error, as httpx_aiohttp does (aiohttp's "failed to send bytes" is a ConnectTimeout).
    """

    def __init__(self, got_first: asyncio.Event | None = None) -> None:
        self.received: list[bytes] = []
        self.got_first = got_first

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        try:
            async for chunk in request.stream:
                self.received.append(chunk)
                if self.got_first is not None:
                    self.got_first.set()
        except Exception as exc:
            raise httpx.ConnectTimeout("failed to send bytes") from exc
        return httpx.Response(200, content=b"ok")


async def read_all(body: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in body]


# The upstream URL


@pytest.mark.parametrize(
    ("base_url", "path", "query", "url"),
    [
        ("http://up.test/v1", "/v1/embeddings", "", "http://up.test/v1/embeddings"),
        ("http://up.test/v1/", "/v1/audio/speech", "x=1", "http://up.test/v1/audio/speech?x=1"),
        ("http://up.test/openai", "/v1/moderations", "", "http://up.test/openai/moderations"),
        ("http://up.test/v1", "/v1/files/a%2Fb/content", "q=%20z", None),
    ],
)
def test_upstream_url_is_the_base_url_and_the_path_after_v1(
    base_url: str, path: str, query: str, url: str | None
) -> None:
    expected = url or f"http://up.test/v1{path[3:]}?{query}"
    assert upstream_url(base_url, path, query) == expected  # still percent-encoded


@pytest.mark.parametrize(
    "path",
    [
        "/embeddings",
        "/v1",
        "/v2/x",
        "/v1/../admin",
        "/v1/%2e%2E/admin",
        "/v1/a/./b",
        # climbed by a server in front that decodes and normalises the path (nginx does)
        "/v1/x%2F..%2F..%2Fadmin",
        "/v1/x\\..\\..\\admin",
        "/v1/x%5C..%5Cadmin",
    ],
)
def test_upstream_url_refuses_other_paths_and_dot_segments(path: str) -> None:
    with pytest.raises(ValueError, match="path"):
        upstream_url("http://up.test/v1", path)


async def test_relay_sends_method_url_and_query_to_the_upstream() -> None:
    seen: list[httpx.Request] = []
    up = upstream(recording(httpx.Response(200), seen))
    async with relay(up, "DELETE", "/v1/files/f-1", query="purge=1&x=%20y"):
        pass
    assert seen[0].method == "DELETE"
    assert str(seen[0].url) == "http://up.test/v1/files/f-1?purge=1&x=%20y"


# Headers


CLIENT_HEADERS = [
    (b"host", b"proxy.test"),
    (b"authorization", b"Bearer proxy-key"),
    (b"content-type", b"application/json"),
    (b"content-length", b"17"),
    (b"accept", b"text/event-stream"),
    (b"accept-encoding", b"gzip, br"),
    (b"openai-organization", b"org-1"),
    (b"openai-beta", b"assistants=v2"),
    (b"x-custom", b"kept"),
    (b"connection", b"keep-alive, x-hop"),
    (b"keep-alive", b"timeout=5"),
    (b"x-hop", b"named by connection"),
    (b"te", b"trailers"),
    (b"trailer", b"x-checksum"),
    (b"upgrade", b"h2c"),
    (b"proxy-authorization", b"Basic eDp5"),
    (b"traceparent", b"00-client-trace-01"),
    (b"tracestate", b"vendor=client"),
    (b"baggage", b"user=alice,tenant=acme"),
    (b"expect", b"100-continue"),
]


async def test_request_headers_carry_the_upstream_key_and_trace_and_no_hop_by_hop() -> None:
    seen: list[httpx.Request] = []
    up = upstream(recording(httpx.Response(200), seen), traced=True)
    body = chunks_of(b'{"model": "m-1"}', b"\n")
    async with relay(up, "POST", "/v1/embeddings", headers=CLIENT_HEADERS, body=body):
        pass
    sent = seen[0].headers
    assert sent["authorization"] == "Bearer up-key"
    assert sent["traceparent"] == "00-proxy-trace-01"
    assert sent["host"] == "up.test"
    assert sent["accept-encoding"] == "identity"
    assert sent["transfer-encoding"] == "chunked"  # streamed: the client's length is not sent
    for name, value in [
        ("content-type", "application/json"),
        ("accept", "text/event-stream"),
        ("openai-organization", "org-1"),
        ("openai-beta", "assistants=v2"),
        ("x-custom", "kept"),
    ]:
        assert sent.get_list(name) == [value]
    for name in [
        "content-length",
        "connection",
        "keep-alive",
        "x-hop",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "tracestate",
        "baggage",
        "expect",
    ]:
        assert name not in sent, name
    assert len(sent.get_list("authorization")) == 1
    assert len(sent.get_list("traceparent")) == 1


async def test_the_client_key_and_trace_context_are_dropped_without_a_key_or_hook() -> None:
    seen: list[httpx.Request] = []
    up = upstream(recording(httpx.Response(200), seen), api_key=None)
    async with relay(up, "GET", "/v1/models/m-1", headers=CLIENT_HEADERS):
        pass
    for name in ["authorization", "traceparent", "tracestate", "baggage"]:
        assert name not in seen[0].headers


def test_response_headers_drop_hop_by_hop_and_keep_what_still_holds() -> None:
    got = returned_headers(
        [
            (b"Content-Type", b"application/json"),
            (b"Content-Length", b"12"),
            (b"Content-Encoding", b"gzip"),
            (b"X-Request-Id", b"req-1"),
            (b"Set-Cookie", b"a=1"),
            (b"Set-Cookie", b"b=2"),
            (b"Connection", b"keep-alive, X-Hop"),
            (b"Keep-Alive", b"timeout=5"),
            (b"X-Hop", b"1"),
            (b"Proxy-Authenticate", b"Basic"),
            (b"Date", b"Mon, 01 Jan 2024 00:00:00 GMT"),
            (b"Server", b"upstream"),
        ]
    )
    assert got == [
        (b"content-type", b"application/json"),
        (b"content-length", b"12"),
        (b"content-encoding", b"gzip"),
        (b"x-request-id", b"req-1"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
    ]


def test_a_content_length_beside_a_transfer_encoding_is_dropped() -> None:
    got = returned_headers([(b"transfer-encoding", b"chunked"), (b"content-length", b"5")])
    assert got == []


# Bodies


async def test_the_request_body_is_streamed_to_the_upstream_chunk_by_chunk() -> None:
    got_first = asyncio.Event()
    transport = StreamingUpstream(got_first)

    async def body() -> AsyncIterator[bytes]:
        yield b'{"input": '
        await got_first.wait()  # a relay that buffered the body would never get past this
        yield b'"hello", '
        yield b'"model": "e-1"}'

    async with (
        asyncio.timeout(5),
        relay(upstream(transport), "POST", "/v1/embeddings", body=body()),
    ):
        pass
    assert transport.received == [b'{"input": ', b'"hello", ', b'"model": "e-1"}']


async def test_a_body_without_a_byte_is_sent_as_none() -> None:
    seen: list[httpx.Request] = []
    up = upstream(recording(httpx.Response(200), seen))
    async with relay(up, "GET", "/v1/files", body=chunks_of(b"")):
        pass
    assert seen[0].content == b""
    assert "transfer-encoding" not in seen[0].headers


async def test_the_response_body_comes_back_in_its_chunks_as_they_arrive() -> None:
    first_read = asyncio.Event()
    stream = Chunks(b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n", after_first=first_read)
    headers = {"content-type": "text/event-stream", "x-request-id": "req-1"}
    up = upstream(
        httpx.MockTransport(lambda request: httpx.Response(200, headers=headers, stream=stream))
    )
    received = []
    async with (
        asyncio.timeout(5),
        relay(up, "POST", "/v1/completions", body=chunks_of(b"{}")) as answer,
    ):
        assert answer.status == 200
        assert (b"content-type", b"text/event-stream") in answer.headers
        assert (b"x-request-id", b"req-1") in answer.headers
        async for chunk in answer.body:
            received.append(chunk)
            first_read.set()  # the upstream sends the rest only once the first chunk was read
    assert received == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    assert stream.closed


async def test_an_upstream_error_is_relayed_openai_shaped_with_its_status() -> None:
    error = b'{"error": {"message": "bad input", "type": "invalid_request_error"}}'
    attempts = Attempts()
    body = Chunks(error[:20], error[20:])
    headers = {"content-type": "application/json; charset=utf-8", "x-request-id": "req-1"}
    refusal = httpx.Response(400, headers=headers, stream=body)
    up = upstream(httpx.MockTransport(lambda request: refusal), attempts)
    async with relay(up, "POST", "/v1/embeddings", body=chunks_of(b"{}")) as answer:
        assert answer.status == 400
        assert (b"content-type", JSON.encode()) in answer.headers
        assert (b"x-request-id", b"req-1") in answer.headers
        relayed = b"".join(await read_all(answer.body))
        assert (b"content-length", str(len(relayed)).encode()) in answer.headers
    assert orjson.loads(relayed) == {
        "error": {
            "message": "bad input",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert body.closed
    assert attempts == [("up", "4xx")]


async def test_a_success_status_is_relayed_as_it_came() -> None:
    page = b"<html>not json, and fine</html>"
    answer_of = httpx.Response(203, headers={"content-type": "text/html"}, stream=Chunks(page))
    up = upstream(httpx.MockTransport(lambda request: answer_of))
    async with relay(up, "GET", "/v1/files/f-1/content") as answer:
        assert answer.status == 203
        assert b"".join(await read_all(answer.body)) == page


async def test_the_upstream_response_is_closed_when_the_block_ends_unread() -> None:
    stream = Chunks(b"a", b"b")
    up = upstream(httpx.MockTransport(lambda request: httpx.Response(200, stream=stream)))
    async with relay(up, "GET", "/v1/files/f-1/content"):
        pass
    assert stream.closed


# Failures


def failing(error: Exception) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        raise error

    return httpx.MockTransport(handler)


@pytest.mark.parametrize(
    ("error", "raised", "outcome"),
    [
        (httpx.ConnectError("refused"), UpstreamUnavailable, "connect_error"),
        (httpx.ConnectTimeout("slow"), UpstreamUnavailable, "timeout"),
        (httpx.ReadTimeout("slow"), UpstreamTimeout, "timeout"),
    ],
)
async def test_no_response_is_an_upstream_failure_counted_once_without_retry(
    error: Exception, raised: type[Exception], outcome: str
) -> None:
    attempts = Attempts()
    up = upstream(failing(error), attempts)
    assert up.max_retries > 0
    with pytest.raises(raised):
        async with relay(up, "POST", "/v1/embeddings", body=chunks_of(b"{}")):
            pytest.fail("no answer to relay")
    assert attempts == [("up", outcome)]


@pytest.mark.parametrize(
    ("error", "raised", "outcome"),
    [
        (httpx.ReadError("reset"), UpstreamUnavailable, "connect_error"),
        (httpx.ReadTimeout("slow"), UpstreamTimeout, "timeout"),
    ],
)
async def test_a_failure_midway_through_the_response_body_is_counted_as_that_failure(
    error: Exception, raised: type[Exception], outcome: str
) -> None:
    attempts = Attempts()
    answer_of = httpx.Response(200, stream=Failing(error))
    up = upstream(httpx.MockTransport(lambda request: answer_of), attempts)
    async with relay(up, "GET", "/v1/files/f-1/content") as answer:
        assert await anext(answer.body) == b"part"
        with pytest.raises(raised):
            await anext(answer.body)
    assert attempts == [("up", outcome)]


async def test_a_success_is_counted_once_whether_its_body_was_read_or_not() -> None:
    attempts = Attempts()
    answer_of = httpx.Response(200, stream=Chunks(b"a", b"b"))
    up = upstream(httpx.MockTransport(lambda request: answer_of), attempts)
    async with relay(up, "GET", "/v1/files/f-1/content") as answer:
        assert b"".join(await read_all(answer.body)) == b"ab"
    async with relay(up, "GET", "/v1/files/f-1/content"):
        pass
    assert attempts == [("up", "2xx"), ("up", "2xx")]


async def test_a_client_body_that_fails_is_raised_as_itself_and_not_counted() -> None:
    attempts = Attempts()

    async def body() -> AsyncIterator[bytes]:
        yield b"--boundary\r\n"
        raise ClientDisconnected("client left")

    with pytest.raises(ClientDisconnected):
        async with relay(
            upstream(StreamingUpstream(), attempts), "POST", "/v1/audio/transcriptions", body=body()
        ):
            pytest.fail("no answer to relay")
    assert attempts == []


# The model of a request


@pytest.mark.parametrize(
    ("content_type", "body", "model"),
    [
        (JSON, b'{"input": ["a"], "model": "text-embedding-3-small"}', "text-embedding-3-small"),
        ("application/json; charset=utf-8", b'{"model": "m"}', "m"),
        ("application/vnd.api+json", b'{"model": "m"}', "m"),
        ("multipart/form-data; boundary=x", b'{"model": "m"}', None),
        (None, b'{"model": "m"}', None),
        (JSON, b'[{"model": "m"}]', None),
        (JSON, b'"m"', None),
        (JSON, b'{"model": 4}', None),
        (JSON, b'{"input": {"model": "nested"}}', None),
        (JSON, b'{"model": "m"', None),
        (JSON, b"", None),
    ],
)
def test_json_model(content_type: str | None, body: bytes, model: str | None) -> None:
    assert json_model(content_type, body) == model


def test_json_model_does_not_parse_a_body_over_the_limit() -> None:
    body = orjson.dumps({"model": "m", "input": "x" * 100})
    assert json_model(JSON, body, limit=len(body)) == "m"
    assert json_model(JSON, body, limit=len(body) - 1) is None


class Counted:
    """A client body that counts how many chunks were taken from it."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.taken = 0

    def __aiter__(self) -> Counted:
        return self

    async def __anext__(self) -> bytes:
        if self.taken == len(self.chunks):
            raise StopAsyncIteration
        self.taken += 1
        return self.chunks[self.taken - 1]


async def test_sniff_model_reads_a_json_body_and_gives_all_of_it_back() -> None:
    body = Counted(b'{"input": "a", ', b'"model": "e-1"}')
    model, rest = await sniff_model([(b"content-type", JSON.encode())], body)
    assert model == "e-1"
    assert b"".join(await read_all(rest)) == b'{"input": "a", "model": "e-1"}'


async def test_sniff_model_stops_reading_past_the_limit_and_gives_all_of_it_back() -> None:
    body = Counted(b'{"model": "e-1", ', b'"input": "', b"x" * 64, b'"}')
    model, rest = await sniff_model([(b"content-type", JSON.encode())], body, limit=20)
    assert model is None
    assert body.taken == 2
    assert b"".join(await read_all(rest)) == b'{"model": "e-1", "input": "' + b"x" * 64 + b'"}'


async def test_sniff_model_parses_no_body_of_more_values_than_the_bound() -> None:
    many = b'{"model": "e-1", "input": [' + b"[]," * 50 + b"[]]}"  # about 105 values
    json = [(b"content-type", JSON.encode())]
    model, rest = await sniff_model(json, Counted(many), max_values=100)
    assert model is None  # the default upstream's, unparsed
    assert b"".join(await read_all(rest)) == many
    model, _ = await sniff_model(json, Counted(many), max_values=110)
    assert model == "e-1"


def form(*parts: tuple[str, bytes, str | None], boundary: str = "b0und") -> tuple[bytes, bytes]:
    """A multipart form of (name, value, filename) parts, and its content type."""
    body = b""
    for name, value, filename in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode()
        body += value + b"\r\n"
    return (
        body + f"--{boundary}--\r\n".encode(),
        f"multipart/form-data; boundary={boundary}".encode(),
    )


def pieces(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


@pytest.mark.parametrize("exact", [False, True])
async def test_sniff_model_reads_a_form_until_its_model_field_and_gives_all_of_it_back(
    exact: bool,
) -> None:
    audio = bytes(range(256)) * 64
    body, content_type = form(("model", b"whisper-1", None), ("file", audio, "a.wav"))
    sent = Counted(*pieces(body, 50))
    model, rest = await sniff_model([(b"content-type", content_type)], sent, exact=exact)
    assert model == "whisper-1"
    assert sent.taken == 2  # the field ended in the second read: the file is not read
    assert b"".join(await read_all(rest)) == body


@pytest.mark.parametrize(
    "parts",
    [
        [("MODEL", b"m-1", None), ("model", b"m-2", None)],  # some match it
        [("model", b"m-1", "model.txt")],  # a file
        [("model", b"m" * 257, None)],  # no model name
        [("file", b"x" * 100, "a.wav"), ("model", b"m-1", None)],  # past the bytes read
    ],
)
async def test_a_form_whose_model_is_not_one_field_early_on_has_none(
    parts: list[tuple[str, bytes, str | None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_module, "FORM_MODEL_WITHIN", 80)
    body, content_type = form(*parts)
    sent = Counted(*pieces(body, 40))
    model, rest = await sniff_model([(b"content-type", content_type)], sent)
    assert model is None
    assert b"".join(await read_all(rest)) == body


async def test_a_form_that_is_no_form_has_no_model() -> None:
    body = b"--b0und\r\nContent-Disposition form-data\r\n\r\nm-1\r\n--b0und--\r\n"
    headers = [(b"content-type", b"multipart/form-data; boundary=b0und")]
    model, rest = await sniff_model(headers, Counted(body), exact=True)
    assert model is None
    assert b"".join(await read_all(rest)) == body


async def test_a_checked_form_fails_at_a_second_model_before_it_goes_on() -> None:
    """The key's model is checked in the first part; one named again after a file of any size
    fails the body before its part is relayed, so the upstream never gets the whole form."""
    audio = b"x" * 10_000
    body, content_type = form(
        ("model", b"m-1", None), ("file", audio, "a.wav"), ("Model", b"m-2", None)
    )
    model, rest = await sniff_model(
        [(b"content-type", content_type)], Counted(*pieces(body, 1000)), exact=True
    )
    assert model == "m-1"
    relayed: list[bytes] = []

    async def relay() -> None:
        async for chunk in rest:
            relayed.append(chunk)

    with pytest.raises(AmbiguousModel):
        await relay()
    assert len(relayed) > 5  # the file went on as it came
    assert body.startswith(b"".join(relayed))
    assert b"m-2" not in b"".join(relayed)
    for sent in (Counted(body), Counted(*pieces(body, 1000))):
        unchecked, rest = await sniff_model([(b"content-type", content_type)], sent)
        assert unchecked == "m-1"  # the first's upstream, for a key whose models are not checked
        assert b"".join(await read_all(rest)) == body
    model, _ = await sniff_model([(b"content-type", content_type)], Counted(body), exact=True)
    assert model is None  # both in the bytes read


FIRST = b'--b0und\r\nContent-Disposition: form-data; name="model"\r\n\r\nm-1\r\n'
FILE = b'--b0und\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n'


@pytest.mark.parametrize(
    "part",
    [
        # a header twice: parsers take the first (busboy, Go) or the last (python-multipart)
        b'Content-Disposition: form-data; name="model"\r\nContent-Disposition: form-data; name="x"',
        b'Content-Disposition: form-data; name="model"; name="x"',  # a name twice
        b"Content-Disposition: form-data; name*=utf-8''model",  # RFC 2231, decoded or not
        b'Content-Disposition: form-data; name="\\x6dodel"',  # some decode escapes
        b'Content-Disposition: form-data; name="%6Dodel"',
        b'Content-Disposition: form-data; name="mod\xe8l"',
        b'Content-Disposition: form-data; name="_charset_"',  # the others read by it
    ],
)
async def test_a_checked_form_is_cut_off_at_a_part_parsers_may_read_otherwise(part: bytes) -> None:
    """Each of these is a second `model` to some upstream's parser."""
    body = FIRST + FILE + b"--b0und\r\n" + part + b"\r\n\r\nm-2\r\n--b0und--\r\n"
    headers = [(b"content-type", b"multipart/form-data; boundary=b0und")]
    model, rest = await sniff_model(
        headers, Counted(FIRST, FILE, body[len(FIRST + FILE) :]), exact=True
    )
    assert model == "m-1"
    with pytest.raises(AmbiguousModel):
        await read_all(rest)
    unchecked, rest = await sniff_model(headers, Counted(body))  # routed by the first model
    assert unchecked == "m-1"
    assert b"".join(await read_all(rest)) == body


@pytest.mark.parametrize(
    ("content_type", "disposition"),
    [
        # a filename with `; name=` in it: one name, as every parser reads it
        (b"multipart/form-data; boundary=b0und", b'name="file"; filename="take 2; name=x.wav"'),
        (b"multipart/form-data; boundary=b0und", b"name=\"file\"; filename*=UTF-8''t%C3%A9.wav"),
        (b"multipart/form-data; boundary=b0und;", b'name="file"; filename="a.wav"'),  # a last `;`
        (b'Multipart/Form-Data; Boundary="b0und"', b'name="file"; filename="a.wav"'),
    ],
)
async def test_a_checked_form_as_clients_send_it_goes_on_whole(
    content_type: bytes, disposition: bytes
) -> None:
    upload = b"--b0und\r\nContent-Disposition: form-data; " + disposition + b"\r\n"
    body = FIRST + upload + b"Content-Type: audio/wav\r\n\r\nRIFF\r\n--b0und--\r\n"
    sent = Counted(FIRST, body[len(FIRST) :])
    model, rest = await sniff_model([(b"content-type", content_type)], sent, exact=True)
    assert model == "m-1"
    assert b"".join(await read_all(rest)) == body


@pytest.mark.parametrize(
    "headers",
    [
        # a charset the upstream reads the names by (starlette does: `\x6dodel` is `model`)
        [(b"content-type", b"multipart/form-data; boundary=b0und; charset=unicode_escape")],
        # two content types: servers read the first (a form hidden in this one's file)
        [
            (b"content-type", b"multipart/form-data; boundary=other"),
            (b"content-type", b"multipart/form-data; boundary=b0und"),
        ],
        # a boundary longer than the parser takes
        [(b"content-type", b"multipart/form-data; boundary=" + b"x" * 257)],
    ],
)
async def test_a_checked_form_an_upstream_may_read_otherwise_has_no_model(
    headers: list[tuple[bytes, bytes]],
) -> None:
    body = FIRST + FILE + b"--b0und--\r\n"
    model, rest = await sniff_model(headers, Counted(body), exact=True)
    assert model is None
    assert b"".join(await read_all(rest)) == body


async def test_a_form_with_a_boundary_the_parser_refuses_goes_on_unread() -> None:
    long = b"x" * 257
    body = b"--" + long + b'\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
    headers = [(b"content-type", b"multipart/form-data; boundary=" + long)]
    model, rest = await sniff_model(headers, Counted(body))
    assert model is None
    assert b"".join(await read_all(rest)) == body


async def test_a_checked_form_of_more_parts_than_the_bound_is_cut_off_at_the_bound() -> None:
    """Each part costs the event loop some Python: a form of thousands of empty parts is not
    read past MAX_PARTS, checked or not."""
    many = [("model", b"m-1", None)] + [("x", b"", None)] * (MAX_PARTS + 10)
    body, content_type = form(*many)
    headers = [(b"content-type", content_type)]
    model, rest = await sniff_model(headers, Counted(*pieces(body, 100)), exact=True)
    assert model == "m-1"
    with pytest.raises(AmbiguousModel):
        await read_all(rest)
    model, _ = await sniff_model(headers, Counted(body), exact=True)
    assert model is None  # all of it in the bytes read: not parsed past the bound
    reader = FormModel(b"b0und")
    reader.feed(body)
    assert reader.broken
    assert reader.names == ["model"]


@pytest.mark.parametrize(
    "headers",
    [
        [(b"content-type", b"multipart/mixed; boundary=x")],
        [(b"content-type", b"multipart/form-data")],  # no boundary
        [],
        [(b"content-type", JSON.encode()), (b"content-length", b"21")],
    ],
)
async def test_sniff_model_leaves_other_bodies_unread(headers: list[tuple[bytes, bytes]]) -> None:
    body = Counted(b'{"model": ', b'"e-1"}')
    model, rest = await sniff_model(headers, body, limit=20)
    assert model is None
    assert body.taken == 0
    assert await read_all(rest) == [b'{"model": ', b'"e-1"}']


# Upstream.models()


async def test_models_lists_the_object_entries_with_the_upstream_key() -> None:
    listing = {"object": "list", "data": [{"id": "m-1", "object": "model"}, "junk", {"id": "m-2"}]}
    seen: list[httpx.Request] = []
    attempts = Attempts()
    up = upstream(recording(httpx.Response(200, json=listing), seen), attempts)
    assert await up.models() == [{"id": "m-1", "object": "model"}, {"id": "m-2"}]
    request = seen[0]
    assert (request.method, str(request.url)) == ("GET", "http://up.test/v1/models")
    assert request.headers["authorization"] == "Bearer up-key"
    assert "content-type" not in request.headers
    assert request.extensions["timeout"]["read"] == 5.0
    assert attempts == [("up", "2xx")]


async def test_models_raises_the_status_of_an_upstream_that_refuses() -> None:
    response = httpx.Response(401, headers={"content-type": JSON}, content=b'{"error": {}}')
    up = upstream(httpx.MockTransport(lambda request: response))
    with pytest.raises(UpstreamStatusError) as raised:
        await up.models()
    message = "upstream up answered HTTP 401; its application/json body is not shown"
    assert (raised.value.status, raised.value.message) == (401, message)


@pytest.mark.parametrize("body", [b"<html>not json</html>", b"[]", b'{"data": "m-1"}', b"{}"])
async def test_models_raises_a_bad_reply_for_a_body_that_is_no_model_list(body: bytes) -> None:
    up = upstream(httpx.MockTransport(lambda request: httpx.Response(200, content=body)))
    with pytest.raises(UpstreamBadReply):
        await up.models()


async def test_models_raises_unavailable_when_unreachable() -> None:
    attempts = Attempts()
    with pytest.raises(UpstreamUnavailable):
        await upstream(failing(httpx.ConnectError("refused")), attempts).models()
    assert attempts == [("up", "connect_error")]


async def test_an_error_body_too_large_to_be_an_error_is_not_shown() -> None:
    huge = b'{"error": {"message": "' + b"x" * 200_000 + b'"}}'
    refusal = httpx.Response(500, headers={"content-type": JSON}, stream=Chunks(huge))
    up = upstream(httpx.MockTransport(lambda request: refusal))
    async with relay(up, "GET", "/v1/files") as answer:
        relayed = orjson.loads(b"".join(await read_all(answer.body)))
    assert answer.status == 500
    assert relayed["error"]["message"] == (
        "upstream up answered HTTP 500; its application/json body is not shown"
    )
