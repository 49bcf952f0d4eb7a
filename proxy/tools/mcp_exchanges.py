"""How long an MCP HTTP session's exchanges may last, and how often its event stream is opened.

The `mcp` SDK gives up a request a handshake-era server does not answer in time by sending a
`notifications/cancelled`, and reads on: a server that ignores it kept the request's answer
stream open, its events read, for as long as it sent them (ten timed-out calls of a server
sending notifications without end: 96 % of a core). It sends each notification and each answer
to the server's requests one after another, waiting for each: one never acknowledged held every
later message of the session (its calls timed out) for the 300 s read timeout. And it opens the
server's event stream again as soon as the server says (`retry: 0`: 10,000 times in 10 s).

So: a request's exchange, its answer stream too, ends when its call's time is up (`answer_s`),
but for `subscriptions/listen`, which lasts as long as the session, and so does a GET resuming
that answer (one naming the id of an event of it: the SDK resumes a stream that ended before
its answer came, and a server could have it resumed for as long as the session lasted); a
notification's, an answer's or the session's end must be acknowledged within `ack_s` (else it
is given up and the writer goes on); and a GET of the event stream is sent at most once a
second. An exchange given
up before its answer began is answered 504 here, which the SDK takes as the server's failure of
that one message."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

import anyio
import httpx2
import orjson

# A request that lives as long as its session (2026-era servers' change events).
LASTING = frozenset({"subscriptions/listen"})
GET_EVERY_S = 1.0  # the least time between two opens of the server's event stream
# The request extension by which the transport below tells the ids of a request's answer's
# events (a GET naming one resumes that answer, within its time).
EVENT_IDS = "loopwarden.event_ids"
RESUMABLE_KEPT = 256  # answers' event ids kept, the latest


class AnswerOutlived(httpx2.StreamError):
    """A JSON answer still coming when its call's time was up."""


class EventsOutlived(httpx2.SSEError):
    """An answer's event stream still going when its call's time was up (the SDK ends the
    request it answers)."""


def outlived(seconds: float) -> str:
    return f"the server's answer went on past {seconds:g} s"


class TimedExchanges(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, answer_s: float, ack_s: float) -> None:
        self.inner = inner
        self.answer_s = answer_s
        self.ack_s = ack_s
        self._last_get = -GET_EVERY_S
        # The event ids of requests' answers, each with the time its request's exchange ends.
        self._resumable: OrderedDict[str, float] = OrderedDict()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.method == "GET":
            resumed = self._resumable.get(request.headers.get("last-event-id", ""))
            if resumed is not None:  # a request's answer, resumed: within its time
                request.extensions = {**request.extensions, EVENT_IDS: self._resuming(resumed)}
                return await self._within_time(request, resumed)
            now = anyio.current_time()  # the event stream: a turn a second after the last
            turn = self._last_get = max(now, self._last_get + GET_EVERY_S)
            if turn > now:
                await anyio.sleep(turn - now)
            return await self.inner.handle_async_request(request)
        within = self._within(await _body(request) if request.method == "POST" else b"")
        if within is None:
            return await self.inner.handle_async_request(request)
        until = anyio.current_time() + within
        request.extensions = {**request.extensions, EVENT_IDS: self._resuming(until)}
        return await self._within_time(request, until)

    def _resuming(self, until: float) -> Callable[[str], None]:
        """What keeps the event ids of an answer whose exchange ends at `until`."""

        def seen(event_id: str) -> None:
            self._resumable[event_id] = until
            while len(self._resumable) > RESUMABLE_KEPT:
                self._resumable.popitem(last=False)

        return seen

    async def _within_time(self, request: httpx2.Request, until: float) -> httpx2.Response:
        within = max(until - anyio.current_time(), 0)
        try:
            with anyio.fail_after(within):
                response = await self.inner.handle_async_request(request)
        except TimeoutError:
            # An answer of the proxy's own: the SDK fails the request it carried (an error
            # raised here would end the whole session), or goes on to the next message.
            return httpx2.Response(504, text=outlived(within), request=request)
        events = response.headers.get("content-type", "").lower().startswith("text/event-stream")
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=_Until(response.stream, until, within, events),
            extensions=response.extensions,
        )

    def _within(self, body: bytes) -> float | None:
        """How long the exchange of a POST of `body` (or of a DELETE, the session's end, with
        none) may last: None for one that lasts with the session."""
        if not body:
            return self.ack_s
        try:
            message = orjson.loads(body)
        except orjson.JSONDecodeError:
            return self.answer_s
        if not isinstance(message, dict) or "method" not in message or "id" not in message:
            return self.ack_s  # a notification, or an answer to the server's request
        return None if message["method"] in LASTING else self.answer_s

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _body(request: httpx2.Request) -> bytes:
    """A request's body: read, for one a redirect made anew."""
    try:
        return request.content
    except httpx2.RequestNotRead:
        return await request.aread()


class _Until(httpx2.AsyncByteStream):
    """A body read until `until` (the event loop's clock), and no longer."""

    def __init__(
        self, inner: httpx2.AsyncByteStream, until: float, within: float, events: bool
    ) -> None:
        self.inner = inner
        self.until = until
        self.within = within
        self.events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = self.inner.__aiter__()
        while True:
            try:
                with anyio.fail_after(max(self.until - anyio.current_time(), 0)):
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                error = EventsOutlived if self.events else AnswerOutlived
                raise error(outlived(self.within)) from None
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()
