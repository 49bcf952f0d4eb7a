"""How the proxy reaches one MCP server: a stdio child or streamable HTTP, through the `mcp`
SDK's own transports, with a watch on the connection's end."""

from __future__ import annotations

import codecs
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx2
from httpx2 import ServerSentEvent
from httpx2._sse import _SSEParser  # what the SDK's EventSource parses with: the same events
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage

from proxy.config.tools import ToolConfig
from proxy.egress import Egress
from proxy.json_values import holds_over
from proxy.throttled_log import ThrottledWarnings, described
from proxy.tools.base import TOOL_KEEPALIVE_S
from proxy.tools.mcp_asked import AnswerWrites, AskedRequests
from proxy.tools.mcp_exchanges import EVENT_IDS, TimedExchanges
from proxy.tools.mcp_stdio import stdio_client, too_large, too_many_values

SESSION_HEADER = "mcp-session-id"
CONNECTION_ENDED = "the connection ended"
# An HTTP session's longest silence while a response streams; calls have their own timeout_s.
READ_TIMEOUT_S = 300.0
# httpx's own bounds on an HTTP session's connections, with a shorter keep-alive.
_LIMITS = httpx2.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=TOOL_KEEPALIVE_S
)
# Calls at once on one HTTP session: its pool less the event stream and a listing or two.
MAX_HTTP_CALLS = 96
# What a request's exchange may take past its call's time (`mcp_exchanges`).
ANSWER_GRACE_S = 1.0
# Redirects within the server's origin followed for one message (a trailing slash's): each
# sends the message again (a loop sent a tool call 21 times).
MAX_REDIRECTS = 2
# Events of one stream: at most this many a second, after a burst of EVENT_BURST (a server
# sending notifications without end held a core).
EVENTS_PER_S = 200
EVENT_BURST = 1000


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a source's server is, for spans: `server.address` and `server.port` (HTTP)."""

    transport: str  # "pipe" (stdio) or "tcp"
    address: str | None = None
    port: int | None = None


def resolve_env(names: Mapping[str, str], env: Mapping[str, str], what: str) -> dict[str, str]:
    """`{key: value}` from `{key: NAME_OF_VARIABLE}`; ValueError naming the first unset one."""
    values = {}
    for key, variable in names.items():
        value = env.get(variable)
        if value is None:
            raise ValueError(f"environment variable {variable} ({what} {key}) is not set")
        values[key] = value
    return values


def endpoint(cfg: ToolConfig) -> Endpoint:
    if cfg.url is None:
        return Endpoint("pipe")
    parts = urlsplit(cfg.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return Endpoint("tcp", parts.hostname, port)


class WatchedStream:
    """A transport's read stream that calls `on_end` once when the server's side ends (a stdio
    child that exits, a transport torn down), so that a dropped session is noticed while idle,
    and that drops the server's requests past those `asked` admits."""

    def __init__(self, inner: Any, on_end: Callable[[str], None], asked: AskedRequests) -> None:
        self.inner = inner
        self.on_end = on_end
        self.asked = asked

    @property
    def last_context(self) -> Any:
        return getattr(self.inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        try:
            item: SessionMessage | Exception = await self.inner.receive()
            while not self.asked.admit(item):
                item = await self.inner.receive()
            return item
        except BaseException:
            self.on_end(CONNECTION_ENDED)
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __aiter__(self) -> WatchedStream:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> WatchedStream:
        await self.inner.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool | None:
        self.on_end(CONNECTION_ENDED)
        result: bool | None = await self.inner.__aexit__(exc_type, exc_val, exc_tb)
        return result


@contextlib.asynccontextmanager
async def open_transport(
    cfg: ToolConfig,
    secrets: Mapping[str, str],
    on_end: Callable[[str], None],
    on_session: Callable[[str], None],
    max_values: int,
    server: str,
) -> AsyncIterator[tuple[Any, Any]]:
    """The transport for `cfg`: a stdio child with `secrets` as its extra environment, or
    streamable HTTP with `secrets` as headers (through the environment's web proxy, if it names
    one for the URL's host). `on_session` gets the HTTP session id the server
    assigns; `on_end` is told why the connection ended, when it does. A message the server
    sends holds at most `max_values` JSON values, and `cfg.max_message_bytes`; its requests
    are bounded (`mcp_asked`), told in the log as `server`'s."""
    asked = AskedRequests(server)
    try:
        async with _transport(cfg, secrets, on_end, on_session, max_values) as (read, write):
            yield WatchedStream(read, on_end, asked), AnswerWrites(write, asked)
    finally:
        asked.close()


@contextlib.asynccontextmanager
async def _transport(
    cfg: ToolConfig,
    secrets: Mapping[str, str],
    on_end: Callable[[str], None],
    on_session: Callable[[str], None],
    max_values: int,
) -> AsyncIterator[tuple[Any, Any]]:
    if cfg.command is not None:
        child = stdio_client(cfg.command, secrets, cfg.max_message_bytes, max_values, on_end)
        async with child as (read, write):
            yield read, write
        return
    assert cfg.url is not None

    async def seen(response: httpx2.Response) -> None:
        session = response.headers.get(SESSION_HEADER)
        if session:
            on_session(session)

    timeout = httpx2.Timeout(cfg.connect_timeout_s, read=max(READ_TIMEOUT_S, cfg.timeout_s))
    limit = cfg.max_message_bytes
    where = urlsplit(cfg.url)
    web = Egress().proxy_for(where.scheme, where.hostname or "")
    proxy = None if web is None else httpx2.Proxy(web.url, auth=web.auth)
    pool = httpx2.AsyncHTTPTransport(limits=_LIMITS, proxy=proxy)
    answer_s = max(cfg.timeout_s, cfg.connect_timeout_s) + ANSWER_GRACE_S
    http = httpx2.AsyncClient(
        headers={**secrets, "accept-encoding": "identity"},  # the bounds count what is read
        timeout=timeout,
        event_hooks={"response": [seen]},
        transport=TimedExchanges(
            BoundedBodies(pool, limit, max_values), answer_s, cfg.connect_timeout_s
        ),
        max_redirects=MAX_REDIRECTS,
    )
    session = streamable_http_client(cfg.url, http_client=http, max_sse_event_size=limit)
    async with http, session as (read, write):
        yield read, write


class BodyTooLarge(httpx2.StreamError):
    """A JSON answer longer than the bound: the SDK fails the request it answered."""


class AnswerRefused(httpx2.StreamError):
    """An answer encoded (compressed) although the client asked for none: its bounds would
    count the bytes read, not the far more it decodes to."""


def encoded(encoding: str) -> str:
    return f"the server sent an answer encoded with {encoding} (content-encoding), not asked for"


class EventTooLarge(httpx2.SSEError):
    """An event of a stream over a bound: the SDK fails the request the stream answers."""


OWN_BOUNDS = (BodyTooLarge, AnswerRefused, EventTooLarge)
refused_answers = ThrottledWarnings(logging.getLogger(__name__))


class _BoundsTold(logging.Filter):
    """The SDK logs an answer the proxy's bounds refused (`OWN_BOUNDS`) with its traceback, at
    ERROR, each time (a server answering too much filled the log); the call fails with the
    bound named all the same. Told here in a line, once a second."""

    def filter(self, record: logging.LogRecord) -> bool:
        refused = record.exc_info[1] if record.exc_info else None
        if not isinstance(refused, OWN_BOUNDS):
            return True
        refused_answers.warning("an MCP server's answer was refused: %s", described(refused))
        return False


logging.getLogger("mcp.client.streamable_http").addFilter(_BoundsTold())


class BoundedBodies(httpx2.AsyncBaseTransport):
    """Answers whose bodies are read up to `limit` bytes and let through holding at most
    `values` JSON values; an event stream (which may last for hours) is bounded so event by
    event. An encoded answer is refused."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, limit: int, values: int) -> None:
        self.inner = inner
        self.limit = limit
        self.values = values

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self.inner.handle_async_request(request)
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        encoding = response.headers.get("content-encoding", "identity")
        if encoding.strip().lower() not in ("identity", ""):
            await response.aclose()
            raise AnswerRefused(encoded(encoding))
        stream: httpx2.AsyncByteStream
        if response.headers.get("content-type", "").lower().startswith("text/event-stream"):
            encoding = response.encoding or "utf-8"  # as the SDK's `aiter_text` will decode it
            stream = _BoundedEvents(
                response.stream,
                self.limit,
                self.values,
                encoding,
                request.extensions.get(EVENT_IDS),
            )
        else:
            declared = response.headers.get("content-length", "")
            length = int(declared) if declared.isdigit() else 0
            stream = _Bounded(response.stream, self.limit, self.values, length)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=stream,
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Bounded(httpx2.AsyncByteStream):
    """A body read whole (the SDK reads a JSON answer whole anyway), then counted."""

    def __init__(self, inner: httpx2.AsyncByteStream, limit: int, values: int, declared: int):
        self.inner = inner
        self.limit = limit
        self.values = values
        self.declared = declared

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.declared > self.limit:
            raise BodyTooLarge(too_large(self.limit))
        chunks: list[bytes] = []
        size = 0
        async for chunk in self.inner:
            size += len(chunk)
            if size > self.limit:
                raise BodyTooLarge(too_large(self.limit))
            chunks.append(chunk)
        body = b"".join(chunks)
        if await holds_over(body, self.values):
            raise BodyTooLarge(too_many_values(self.values))
        yield body

    async def aclose(self) -> None:
        await self.inner.aclose()


class _BoundedEvents(httpx2.AsyncByteStream):
    """An event stream let through as it comes, read first as the SDK will read it: decoded
    with the answer's charset and parsed by httpx2's own event parser, the one the SDK's
    `EventSource` runs, so both see the same events. Each event holds at most `limit` bytes
    and its data at most `values` JSON values, checked before the chunk that completes it (or
    the stream's end, which may complete one) is let through."""

    def __init__(
        self,
        inner: httpx2.AsyncByteStream,
        limit: int,
        values: int,
        encoding: str = "utf-8",
        on_id: Callable[[str], None] | None = None,
    ) -> None:
        self.inner = inner
        self.limit = limit
        self.values = values
        self.encoding = encoding
        self.on_id = on_id  # told each event's id
        self.allowed = float(EVENT_BURST)  # events it may send now
        self.at = time.monotonic()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        text = codecs.getincrementaldecoder(self.encoding)(errors="replace")
        parser = _SSEParser(self.limit)
        async for chunk in self.inner:
            await self._check(parser.decode(text.decode(chunk)))
            yield chunk
        await self._check(chain(parser.decode(text.decode(b"", True)), parser.flush()))

    async def _check(self, events: Iterable[ServerSentEvent]) -> None:
        """`events` as the parser yields them (it raises as one grows over `limit`)."""
        try:
            parsed = list(events)
        except httpx2.SSEError:
            raise EventTooLarge(too_large(self.limit)) from None
        if parsed:
            now = time.monotonic()
            self.allowed = min(EVENT_BURST, self.allowed + (now - self.at) * EVENTS_PER_S)
            self.at = now
            self.allowed -= len(parsed)
            if self.allowed < 0:
                raise EventTooLarge(f"the server sent more than {EVENTS_PER_S} events a second")
        for event in parsed:
            if await holds_over(event.data.encode(), self.values):
                raise EventTooLarge(too_many_values(self.values))
            if event.id and self.on_id is not None:
                self.on_id(event.id)

    async def aclose(self) -> None:
        await self.inner.aclose()
