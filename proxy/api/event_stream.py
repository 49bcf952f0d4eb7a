"""A server-sent event stream written straight to ASGI `send`: the HTTP response starts with
the first byte sent (so a run that fails before then still gets a plain HTTP error), and an
SSE comment keeps an idle stream alive. The chat and Responses writers build on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping

from starlette.types import Send

from proxy.api.asgi import header_list
from proxy.errors import ClientDisconnected
from proxy.telemetry.http import CUT_ON_PURPOSE

log = logging.getLogger(__name__)

KEEPALIVE = b": keep-alive\n\n"
WRITE_SLICE = 1 << 20
FINISH_S = 3.0  # what a write in slices cancelled midway gets to end its events


class EventStream:
    def __init__(self, send: Send, headers: dict[str, str]) -> None:
        self.send = send
        self.headers = headers
        self.started = False  # the HTTP response has begun
        self.last_write = time.monotonic()
        # A write in slices under way (set as it ends): others' writes wait for it, since
        # theirs would land in its events; and whether one stopped midway (its send failed, or
        # it was cancelled and did not end within `finish_s`): the stream says no more, since
        # whatever followed would be read as the rest of its event.
        self._slicing: asyncio.Event | None = None
        self.cut = False
        # Cut by the proxy itself (a write cancelled midway that did not end in `finish_s`):
        # what follows is not sent, though the run goes on to its end (its stop as it was).
        self.silenced = False
        self.finish_s = FINISH_S

    async def _write(self, *parts: bytes, last: bool = False) -> None:
        """Sends `parts`; `last`: as the response's end, in the same message. A part longer
        than WRITE_SLICE (a long text's events) goes in slices, each of them a turn for the
        others: the server copies what it sends, and waits between them for a slow reader.
        Raises ClientDisconnected once a write was cut short in the middle of an event (the
        client gone); once the proxy cut it (`silenced`), nothing is sent."""
        while self._slicing is not None:
            await self._slicing.wait()
        if self.silenced:
            return
        if self.cut:
            raise ClientDisconnected("the stream was cut short in the middle of an event")
        try:
            if not self.started:
                self.started = True
                raw = [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                    *header_list(self.headers),
                ]
                await self.send({"type": "http.response.start", "status": 200, "headers": raw})
            if len(parts) == 1 and len(parts[0]) <= WRITE_SLICE:
                await self.send(
                    {"type": "http.response.body", "body": parts[0], "more_body": not last}
                )
            else:
                await self._write_long(parts, last)
        except OSError as exc:
            raise ClientDisconnected(str(exc)) from None
        self.last_write = time.monotonic()

    async def _write_long(self, parts: tuple[bytes, ...], last: bool) -> None:
        """Sends `parts` in slices. Cancelled meanwhile (a time budget, the drain's end), it
        goes on for `finish_s` at most, so that its events end whole and the stream can still
        say how the run ended; then it is cut."""
        ended = self._slicing = asyncio.Event()
        sending = asyncio.ensure_future(self._slices(parts, last))
        sending.add_done_callback(_read)
        try:
            await asyncio.shield(sending)
        except asyncio.CancelledError:
            try:
                await asyncio.wait((sending,), timeout=self.finish_s)
            finally:
                if not sending.done():
                    sending.cancel()
                    self.silenced = True
                    CUT_ON_PURPOSE.set(True)  # (told here: the server need not say it again)
                    log.warning(
                        "a stream was cut in the middle of an event: its reader did not take "
                        "the rest of it within %g s once its run was stopped",
                        self.finish_s,
                    )
            raise
        finally:
            self._slicing = None
            ended.set()

    async def _slices(self, parts: tuple[bytes, ...], last: bool) -> None:
        short: list[bytes] = []
        for part in parts:
            if len(part) <= WRITE_SLICE:
                short.append(part)
                continue
            for at in range(0, len(part), WRITE_SLICE):
                body = b"".join((*short, part[at : at + WRITE_SLICE]))
                short = []
                self.cut = True  # until the rest is sent
                await self.send({"type": "http.response.body", "body": body, "more_body": True})
                self.last_write = time.monotonic()
                await asyncio.sleep(0)
        body = b"".join(short)
        if not body:  # the events ended with the last slice: whole
            self.cut = False
        await self.send({"type": "http.response.body", "body": body, "more_body": not last})
        self.cut = False

    def heard(self, head: Mapping[str, str]) -> None:
        """What an upstream's answer carries beside its text: a stream may show it."""

    async def begin(self) -> None:
        """Starts the response, if nothing has yet: an upstream's answer has begun."""
        if not self.started:
            await self._write(self.opening())

    def opening(self) -> bytes:
        """What a response that starts before it has anything to say sends first."""
        return KEEPALIVE

    @contextlib.contextmanager
    def kept_alive(self, interval_s: float) -> Iterator[None]:
        """Inside, an SSE comment goes out whenever nothing was written for `interval_s`."""
        keepalive = _KeepAlive(self, interval_s)
        try:
            yield
        finally:
            keepalive.stop()

    async def comment(self) -> None:
        """Writes a keep-alive comment; a client that has gone is left to the run to notice."""
        with contextlib.suppress(ClientDisconnected):
            await self._write(KEEPALIVE)


class _KeepAlive:
    """A stream's keep-alive: a timer that costs nothing until a comment is due, then writes it
    in a task of its own. Only the pending timer refers back to it, and stopping cancels that
    timer, so a finished stream leaves no reference cycle behind (its whole request would wait
    for the garbage collector)."""

    __slots__ = ("interval_s", "loop", "stream", "timer", "writing")

    def __init__(self, stream: EventStream, interval_s: float) -> None:
        self.stream = stream
        self.interval_s = interval_s
        self.loop = asyncio.get_running_loop()
        self.writing: asyncio.Task[None] | None = None
        self.timer = self.loop.call_later(interval_s, self.due)

    def due(self) -> None:
        wait = self.stream.last_write + self.interval_s - time.monotonic()
        if wait <= 0 and (self.writing is None or self.writing.done()):
            self.writing = self.loop.create_task(self.stream.comment())
            wait = self.interval_s
        self.timer = self.loop.call_later(max(wait, 0.001), self.due)

    def stop(self) -> None:
        self.timer.cancel()
        if self.writing is not None:
            self.writing.cancel()


def _read(task: asyncio.Future[None]) -> None:
    """Reads how a write's sending task ended: once its request's task was cancelled, nothing
    else does, and the loop would log "Task exception was never retrieved"."""
    if not task.cancelled():
        task.exception()
