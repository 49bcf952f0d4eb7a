"""The bounds of what an MCP server over HTTP may send the proxy: an answer's bytes and JSON
values (`max_message_bytes`, `server.max_body_values`), its events' size and rate, and no
encoding the proxy did not ask for; what passes them is read by the SDK as it came."""

from __future__ import annotations

import codecs
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from itertools import chain

import httpx2
from httpx2 import ServerSentEvent
from httpx2._sse import _SSEParser  # what the SDK's EventSource parses with: the same events

from proxy.json_values import holds_over
from proxy.throttled_log import ThrottledWarnings, described
from proxy.tools.mcp_exchanges import EVENT_IDS
from proxy.tools.mcp_stdio import MessageRate, too_frequent, too_large, too_many_values


class AnswerTooLarge(httpx2.StreamError):
    """A JSON answer longer than the bound: the SDK fails the request it answered."""


class AnswerRefused(httpx2.StreamError):
    """An answer encoded (compressed) although the client asked for none: its bounds would
    count the bytes read, not the far more it decodes to."""


def encoded(encoding: str) -> str:
    return f"the server sent an answer encoded with {encoding} (content-encoding), not asked for"


class EventTooLarge(httpx2.SSEError):
    """An event of a stream over a bound: the SDK fails the request the stream answers."""


OWN_BOUNDS = (AnswerTooLarge, AnswerRefused, EventTooLarge)
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


BOUNDS_TOLD = _BoundsTold()


def tell_bounds_in_a_line() -> None:
    """The SDK's log of an answer the bounds refused told by `_BoundsTold` (once: one filter)."""
    logging.getLogger("mcp.client.streamable_http").addFilter(BOUNDS_TOLD)


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
            raise AnswerTooLarge(too_large(self.limit))
        chunks: list[bytes] = []
        size = 0
        async for chunk in self.inner:
            size += len(chunk)
            if size > self.limit:
                raise AnswerTooLarge(too_large(self.limit))
            chunks.append(chunk)
        body = b"".join(chunks)
        if await holds_over(body, self.values):
            raise AnswerTooLarge(too_many_values(self.values))
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
        self.rate = MessageRate()

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
        if parsed and self.rate.over(len(parsed)):
            raise EventTooLarge(too_frequent())
        for event in parsed:
            if await holds_over(event.data.encode(), self.values):
                raise EventTooLarge(too_many_values(self.values))
            if event.id and self.on_id is not None:
                self.on_id(event.id)

    async def aclose(self) -> None:
        await self.inner.aclose()
