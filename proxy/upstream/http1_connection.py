"""One HTTP/1.1 connection to an upstream: an asyncio protocol whose answers are parsed by
httptools (llhttp, the parser uvicorn serves with), and the answer it is receiving.

An answer's body is buffered as it arrives, up to HIGH_WATER bytes before the connection stops
reading (so a slow reader holds a bounded amount), and given to the reader as one piece of all
that came since its last read. A read waits at most the read timeout for a byte.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httptools

HIGH_WATER = 256 * 1024  # body bytes buffered before the connection stops reading
MAX_HEAD = 64 * 1024  # bytes of an answer's header fields
MAX_FIELDS = 256  # header fields of an answer
# The end of a body that the caller did not need (a stream's last chunk after `[DONE]`) is read
# after the caller closed the answer, to keep the connection: for at most this long and this
# many bytes, else the connection is closed.
END_WAIT_S = 0.5
END_BYTES = 65536


class TransportError(Exception):
    """What went wrong with a connection; its subclass says what it means for the call."""


class Unreachable(TransportError):
    """No connection: refused, no route, a name that does not resolve, a TLS handshake that
    failed."""


class ConnectTimeout(TransportError):
    """No connection within the connect timeout."""


class ReadTimeout(TransportError):
    """The upstream stayed silent longer than the read timeout."""


class Broken(TransportError):
    """The connection was closed or reset while in use."""


class NotHttp(Broken):
    """What came is not an HTTP answer (a bad status line, content-length, header...)."""


class Connection(asyncio.Protocol):
    """A connection that carries one request at a time. `on_free` is called once when it can
    carry another (its answer came whole and both ends keep it), `on_lost` once when it closes.
    """

    def __init__(
        self,
        origin: tuple[str, str, int],
        on_free: Callable[[Connection], None],
        on_lost: Callable[[Connection], None],
    ) -> None:
        self.origin = origin  # scheme, host, port
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.on_free = on_free
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.answer: Answer | None = None
        self.idle_since = 0.0
        self.reused = False  # it carried a request before the one out now
        self.heard = False  # a byte came while the request out now was
        self.lost = False
        self._drained: asyncio.Future[None] | None = None  # while writes are paused

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        answer, parser = self.answer, self.parser
        if answer is None or parser is None:  # bytes while no request is out: no HTTP peer
            self.close()
            return
        self.heard = True
        try:
            parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            answer.fail(NotHttp(answer.refused or str(exc)))
            self.close()
            return
        answer.wake()  # once for all the read held: its head, body chunks, end

    def eof_received(self) -> bool:
        return False  # the transport closes itself: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost:
            return
        self.lost = True
        answer = self.answer
        if answer is not None:
            answer.ended_by_close(exc)
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self.on_lost(self)
        # Its parser's callbacks and its answer refer back to it: cycles that would keep what
        # they hold (an answer's buffered body) until a full collection, rare in this process.
        self.parser = None
        self.answer = None

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        answer = self.answer
        if answer is not None and answer.status:
            answer.refused = "the upstream sent an answer that no request asked for"
            raise ValueError(answer.refused)  # stops the parser: feed_data raises

    def on_header(self, name: bytes, value: bytes) -> None:
        answer = self.answer
        if answer is not None:
            answer.add_header(name, value)

    def on_headers_complete(self) -> None:
        answer, parser = self.answer, self.parser
        if answer is not None and parser is not None:
            answer.started(parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        answer = self.answer
        if answer is not None:
            answer.feed(body)

    def on_message_complete(self) -> None:
        answer, parser = self.answer, self.parser
        if answer is not None and parser is not None:
            answer.complete(parser.should_keep_alive())

    # -- ours

    def write(self, data: list[bytes]) -> None:
        if self.lost or self.transport is None:
            raise Broken("the upstream closed the connection while the request was sent")
        self.transport.writelines(data)

    async def drain(self) -> None:
        """Waits while the connection's send buffer is full."""
        if self._drained is not None:
            await self._drained
        if self.lost:
            raise Broken("the upstream closed the connection while the request was sent")

    def pause_reading(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.resume_reading()

    def close(self) -> None:
        """Closes at once (an abort: nothing buffered is worth sending)."""
        if self.transport is not None:
            self.transport.abort()
        # Now, not on the loop's next turn; an answer still coming is not whole.
        self.connection_lost(ConnectionAbortedError("closed by the proxy"))


class Answer:
    """The answer a connection is receiving: its status and header fields, and its body as it
    comes (`chunks()`, read by one reader)."""

    __slots__ = (
        "_chunks",
        "_connection",
        "_done",
        "_drain",
        "_draining",
        "_end_only",
        "_error",
        "_head",
        "_headers",
        "_paused",
        "_read_s",
        "_reusable",
        "_size",
        "_until_close",
        "_waiter",
        "refused",
        "status",
    )

    def __init__(self, connection: Connection, read_s: float) -> None:
        self._connection: Connection | None = connection
        self._read_s = read_s
        self.status = 0
        self._headers: list[tuple[bytes, bytes, bytes]] = []  # (name in lower case, name, value)
        self._head = 0  # bytes of header fields so far
        self._chunks: list[bytes] = []
        self._size = 0
        self._paused = False
        self._done = False  # the whole body came
        self._reusable = False  # ... and the connection may carry another request
        self._until_close = True  # the body ends when the connection does (no length said)
        self._error: TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._end_only = False  # the caller said only the body's end is left
        self._draining = False  # ... and closed the answer: that end is read and dropped
        self._drain: asyncio.TimerHandle | None = None  # which is given up when this fires
        self.refused: str | None = None  # why the head was refused, when it was

    # -- the connection's side

    def add_header(self, name: bytes, value: bytes) -> None:
        self._head += len(name) + len(value)
        if self._head > MAX_HEAD or len(self._headers) >= MAX_FIELDS:
            self.refused = (
                f"the upstream's answer has over {MAX_FIELDS} header fields or "
                f"{MAX_HEAD} bytes of them"
            )
            raise ValueError(self.refused)  # stops the parser: feed_data raises
        lower = name.lower()
        self._headers.append((lower, name, value))
        if lower == b"content-length" or (
            lower == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._until_close = False

    def started(self, status: int) -> None:
        if status < 200:  # an interim answer (103 Early Hints): the real one follows
            if status == 101:
                self.refused = "the upstream switched protocols"
                raise ValueError(self.refused)
            self._headers.clear()
            self._head = 0
            self._until_close = True
            return
        self.status = status
        if status in (204, 304):
            self._until_close = False

    def feed(self, body: bytes) -> None:
        if self._draining:
            self._size += len(body)
            if self._size > END_BYTES:
                self._abandon()
            return
        self._chunks.append(body)
        self._size += len(body)
        if self._size > HIGH_WATER and not self._paused and self._connection is not None:
            self._paused = True
            self._connection.pause_reading()

    def complete(self, keep_alive: bool) -> None:
        if self.status == 0:
            return  # the end of an interim answer
        self._done = True
        self._reusable = keep_alive
        if self._draining:
            self._release()

    def ended_by_close(self, exc: Exception | None) -> None:
        if self._done:
            return
        if exc is None and self.status and self._until_close:
            self._done = True  # a body delimited by the connection's end, now whole
        elif self._error is None:
            self._error = Broken(
                "the upstream closed the connection before its answer was whole"
                if exc is None
                else f"the connection to the upstream was lost ({type(exc).__name__}: {exc})"
            )
        self._connection = None
        self.wake()

    def fail(self, error: TransportError) -> None:
        if self._error is None and not self._done:
            self._error = error
        self.wake()

    def wake(self) -> None:
        """Wakes the reader: as the answer fails or ends with the connection, and once the
        connection parsed a read (not by `started`, `feed`, `complete` each)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the caller's side

    def end_head(self) -> None:
        """For an answer to HEAD: no body follows its head."""
        self._done = True
        self._reusable = False

    async def head(self) -> None:
        """Waits for the answer's status and header fields."""
        while not self.status:
            if self._error is not None:
                raise self._error
            await self._wait()

    def header(self, name: str) -> str | None:
        # Looked up once or twice per answer: a scan, not a dict of all 20-odd fields.
        wanted = name.lower().encode("latin-1")
        for key, _, value in self._headers:
            if key == wanted:
                return value.decode("latin-1")
        return None

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return [(name, value) for _, name, value in self._headers]

    def chunks(self) -> Answer:
        return self

    def __aiter__(self) -> Answer:
        return self

    async def __anext__(self) -> bytes:
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._size = 0
                if self._paused:
                    self._paused = False
                    if self._connection is not None:
                        self._connection.resume_reading()
                return data
            if self._error is not None:
                raise self._error
            if self._done:
                raise StopAsyncIteration
            await self._wait()

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(self._read_s, self._timed_out)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _timed_out(self) -> None:
        self.fail(ReadTimeout(f"no byte from the upstream within {self._read_s:g} s"))
        if self._connection is not None:
            self._connection.close()

    def keep_alive(self) -> None:
        self._end_only = True

    async def aclose(self) -> None:
        """Gives the connection back when the body came whole; reads the body's end first when
        the caller said that only that end is left (`keep_alive`); else closes it."""
        connection = self._connection
        if connection is None or self._draining:
            return
        if self._done and self._error is None:
            self._release()
        elif self._end_only and self._error is None:
            self._draining = True
            self._chunks.clear()
            self._size = 0
            if self._paused:
                self._paused = False
                connection.resume_reading()
            self._drain = asyncio.get_running_loop().call_later(END_WAIT_S, self._abandon)
        else:
            self._abandon()

    def _release(self) -> None:
        connection, self._connection = self._connection, None
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
        if connection is None:
            return
        if self._reusable and not connection.lost:
            connection.answer = None
            connection.on_free(connection)
        else:
            connection.close()

    def _abandon(self) -> None:
        connection, self._connection = self._connection, None
        self._drain = None
        if connection is not None:
            connection.close()
