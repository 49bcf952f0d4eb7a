"""What one client connection may make the server hold: uvicorn's httptools protocol with a cap
on connections (one more is answered 503 and closed), a deadline on a request's head, a bound
on its size (431) and its trailers, no protocol upgrades, and at most MAX_PIPELINED requests
waiting behind the one being answered. The probe listener's connections serve the probe
routes only."""

from __future__ import annotations

import asyncio

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.errors import HeadersTooLarge, InvalidRequest, NotFound, ProxyError, ServerBusy

# The most bytes a request's line and headers may take (an OpenAI client sends a few hundred).
MAX_HEAD_BYTES = 64 * 1024


def _refusal(status: bytes, error: ProxyError, headers: bytes = b"") -> bytes:
    """A whole response to write as the connection is closed, before any request was made."""
    body = orjson.dumps(error.body())
    head = b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n" + headers
    return head + b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body


# What a connection past the limit gets before it is closed.
REFUSED = _refusal(
    b"503 Service Unavailable",
    ServerBusy("the proxy has too many connections open; retry later"),
    b"retry-after: 1\r\n",
)


# The probe listener (`server.probe_port`) serves these only.
PROBE_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})


def answering(error: ProxyError) -> ASGIApp:
    """An app that answers every request with `error` and closes its connection: for a request
    the server refuses once its head came, answered through uvicorn's own cycle."""
    body = orjson.dumps(error.body())
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
    ]

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


NOT_A_PROBE = answering(
    NotFound(f"the probe port serves {', '.join(sorted(PROBE_ROUTES))} only: use the proxy's port")
)


def probe_routes(app: ASGIApp) -> ASGIApp:
    """`app` serving the probe routes only."""

    async def probe(scope: Scope, receive: Receive, send: Send) -> None:
        routed = app if scope["path"] in PROBE_ROUTES else NOT_A_PROBE
        await routed(scope, receive, send)

    return probe


# What a request whose head is longer than MAX_HEAD_BYTES gets before its connection is closed:
# written as it is while the head is still coming, or answered once it came.
_HEAD_ERROR = HeadersTooLarge(
    f"the request's line and headers are longer than {MAX_HEAD_BYTES} bytes"
)
HEAD_TOO_LARGE = _refusal(b"431 Request Header Fields Too Large", _HEAD_ERROR)
HEAD_TOO_LARGE_ANSWER = answering(_HEAD_ERROR)
# Header fields a request may have (nginx and h11 hold about as many): each is work for the
# parser, the ASGI scope and every layer that reads it, and 64 KiB holds 6,000 of one byte.
MAX_HEADERS = 256
TOO_MANY_HEADERS = answering(
    HeadersTooLarge(f"the request has more than {MAX_HEADERS} header fields")
)
# The server speaks HTTP/1.1 only, and its parser stops reading a request that asks for another
# protocol (`connection: upgrade`) where its headers end, its body unread: such a request is
# answered 400 (WebSocket, CONNECT, h2c with a body), except an h2c one without a body, which is
# served and its connection closed after it.
NO_UPGRADE = answering(
    InvalidRequest(
        "the proxy speaks HTTP/1.1 only and upgrades no connection: send the request without "
        "`connection: upgrade`"
    )
)

# The most requests one connection may have waiting behind the one being answered (HTTP/1.1
# pipelining; the SDKs never do), each held whole: those are answered, then the connection is
# closed, and the requests past them are dropped unanswered (a client sees the close).
MAX_PIPELINED = 16

# What a request the HTTP parser cannot read gets (framing, a header without a colon, ...):
# uvicorn's own answer is plain text.
NOT_HTTP = _refusal(
    b"400 Bad Request",
    InvalidRequest("the request is not valid HTTP/1.1: its line, headers or body framing"),
)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds the module says; `guarded_protocol` makes
    one of given settings."""

    max_connections = 0  # the client connections one process holds at once
    header_timeout_s = 0.0  # the deadline of a request's head
    probes = False  # it serves the probe routes only
    # The deadline of a request's head; also of the rest of a request that was answered
    # before it was all sent (data does not put it off, as it does uvicorn's keep-alive).
    _header_timer: asyncio.TimerHandle | None = None
    # The bytes of the reads that left the request's head incomplete; None once its
    # headers are complete. The read in which a request begins is not counted: it may
    # hold the previous request's body too, and its size is bounded (256 KiB at most).
    _head_bytes: int | None = 0
    _began = False  # whether a request began in the read being parsed
    _read_size = 0  # the read being parsed
    _began_size = 0  # the read the request began in
    _in_message = False  # a request is being read, head or body
    _fields = 0  # the request's header fields: any more are its trailers
    # The bytes of the reads since its head that brought none of its body: trailers, chunk
    # framing (an endless trailer line grows the parser's own buffer).
    _quiet_bytes = 0
    _delivered = False  # the read being parsed brought some of the body
    _idle_since = 0.0  # when the connection was made, or last answered a request
    # More than MAX_PIPELINED requests came behind the one being answered: those queued
    # are answered, the connection closes after them, and the rest is read and dropped.
    _overflowed = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.probes:
            self.app = probe_routes(self.app)
        self._idle_since = self.loop.time()
        if len(self.connections) > self.max_connections and not (self.probes and self._make_room()):
            transport.write(REFUSED)
            transport.close()
            return
        self._arm_header_timer()

    def _make_room(self) -> bool:
        """Closes the longest idle connection, if any: one whose request is not being
        answered (kept alive after its answer, its head or its body still to come). On the
        probe port, so that clients holding connections cannot keep out the probes, which
        send their request at once."""
        idle = [
            c
            for c in self.connections
            if isinstance(c, GuardedProtocol)
            and c is not self
            and (c.cycle is None or c.cycle.response_complete)
            and not c.pipeline
            and not c.transport.is_closing()
        ]
        if not idle:
            return False
        min(idle, key=lambda c: c._idle_since).transport.close()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._began = False
        self._delivered = False
        self._read_size = len(data)
        HttpToolsProtocol.data_received(self, data)
        if self._head_bytes is None:
            if self._in_message and not self._delivered:
                # trailers (the parser adds them to the headers) or chunk framing, bounded
                del self.headers[self._fields :]
                self._quiet_bytes += len(data)
                if self._quiet_bytes > MAX_HEAD_BYTES:
                    self.transport.close()
            return
        if self._began:
            return
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self.transport.write(HEAD_TOO_LARGE)
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(NOT_HTTP)
        self.transport.close()

    def on_message_begin(self) -> None:
        HttpToolsProtocol.on_message_begin(self)
        self._head_bytes = 0
        self._began = True
        self._began_size = self._read_size
        self._in_message = True
        self._quiet_bytes = 0
        self._arm_header_timer()

    def on_body(self, body: bytes) -> None:
        self._delivered = True
        self._quiet_bytes = 0
        if not (self.transport.is_closing() or self._overflowed):
            HttpToolsProtocol.on_body(self, body)

    def on_message_complete(self) -> None:
        self._in_message = False
        del self.headers[self._fields :]  # its trailers, if any: no headers of it
        self._disarm_header_timer()
        if not (self.transport.is_closing() or self._overflowed):
            HttpToolsProtocol.on_message_complete(self)

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        HttpToolsProtocol.on_response_complete(self)
        if self._in_message:  # answered before it was all sent: the rest has a deadline
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        # The reads the head came in hold at least its bytes: only when they hold more than
        # the bound is the head itself measured (as parsed: a head completed within one
        # read is never counted above).
        read = self._began_size + (self._head_bytes or 0)
        read += 0 if self._began else self._read_size
        self._head_bytes = None
        self._fields = len(self.headers)
        self._disarm_header_timer()
        if self.transport.is_closing() or self._overflowed:  # nothing more is served
            return
        if len(self.pipeline) >= MAX_PIPELINED:
            self._overflowed = True
            last, _ = self.pipeline[0]  # the newest queued: its answer is the last one
            last.keep_alive = False
            return
        refusal = None
        if read > MAX_HEAD_BYTES and self._parsed_head() > MAX_HEAD_BYTES:
            refusal = HEAD_TOO_LARGE_ANSWER
        elif self._fields > MAX_HEADERS:
            refusal = TOO_MANY_HEADERS
        elif self.parser.should_upgrade() and not self._may_stay_http():
            refusal = NO_UPGRADE
        if refusal is None:
            super().on_headers_complete()
            if self.parser.should_upgrade():  # the parser reads no more on this connection
                self.cycle.keep_alive = False
            return
        app, self.app = self.app, refusal  # uvicorn's own cycle answers it
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def _may_stay_http(self) -> bool:
        """Whether a request that asks to upgrade may be served as it is: an h2c upgrade
        (which a server may ignore; Java's HttpClient asks for it by default) without a
        body, which the parser would not read."""
        fields = dict(self.headers)
        return (
            fields.get(b"upgrade", b"").strip().lower() == b"h2c"
            and fields.get(b"content-length", b"0").strip() == b"0"
            and b"transfer-encoding" not in fields
            and self.parser.get_method() != b"CONNECT"
        )

    def _should_upgrade(self) -> bool:
        return False  # no protocol but HTTP/1.1: see NO_UPGRADE

    def _unsupported_upgrade_warning(self) -> None:
        pass  # answered: NO_UPGRADE

    def _parsed_head(self) -> int:
        """The request line and headers as parsed, framing included."""
        line = len(self.parser.get_method()) + len(self.url) + len(" HTTP/1.1\r\n") + 1
        return line + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(
    max_connections: int, header_timeout_s: float, probes: bool = False
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a cap on connections, a deadline on headers, and
    bounds on what one connection may make the server hold: a request's head, its trailers,
    the requests pipelined behind it. With `probes`, it serves the probe routes only."""
    settings = {
        "max_connections": max_connections,
        "header_timeout_s": header_timeout_s,
        "probes": probes,
    }
    return type("GuardedProtocol", (GuardedProtocol,), settings)
