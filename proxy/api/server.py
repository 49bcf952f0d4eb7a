"""The HTTP server: uvicorn, with bounds on what a client connection may hold.

- At most `server.connection_limit()` client connections: one more is answered 503 and closed
  as it arrives, so that client connections never take the descriptors that upstream, tool and
  state connections need (the default is derived from RLIMIT_NOFILE).
- A request's line and headers must arrive within `server.header_timeout_s` of the connection
  (or of the request's first byte, on a kept-alive connection), else the connection is closed;
  a head longer than MAX_HEAD_BYTES is answered 431 and its connection closed (as soon as that
  many bytes of it came, when it comes in more than one read).
- An idle kept-alive connection is closed after `server.keep_alive_timeout_s`.
- With `server.probe_port`, a second listener serves the probe routes only (/healthz, /readyz,
  /metrics) with connections of its own, so that a client holding every connection of the
  proxy's port does not make the pod look dead.
- The body deadline (`server.body_timeout_s`) and the cap on requests in flight are the app's
  (`proxy.api.admission`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import sys
from typing import Any

import orjson
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy.api.asgi import CUT_ON_PURPOSE
from proxy.config.server import ServerConfig
from proxy.errors import HeadersTooLarge, InvalidRequest, NotFound, ProxyError, ServerBusy

log = logging.getLogger(__name__)

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


# The probe listener (`server.probe_port`): what it serves, the connections it holds at once (a
# kubelet and a scraper or two need a few; past it, the longest idle one is closed), and its
# queue of connections not yet accepted.
PROBE_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})
PROBE_CONNECTIONS = 32
PROBE_BACKLOG = 64


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

# The cyclic garbage collector, as it comes, scans the whole heap of start-up (the config, the
# tool schemas, the libraries' modules) again and again under load: measured, a fifth of the
# CPU. Once serving, that heap is frozen out of its scans, and the young generation collected
# every 20,000 net allocations rather than 700 (a run leaves no cycles behind: what it
# allocates is freed by reference counting; tests/integration/test_request_garbage.py).
GC_THRESHOLDS = (20_000, 10, 10)

# A thread running Python (a sync tool that computes, the span exporter encoding a batch) keeps
# the GIL until the interpreter's switch interval asks it to let go, and the event loop waits
# that long each time it wakes: with the default 5 ms, a tool thread spinning made each I/O
# round trip of the loop take 15 ms (p50); at 0.5 ms, 0.02 ms. Without such a thread the
# interval is never used.
SWITCH_INTERVAL_S = 0.0005


def settle_runtime() -> None:
    """Once serving: collects the garbage of start-up, keeps what is left out of later
    collections, and shortens the GIL's switch interval."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    sys.setswitchinterval(SWITCH_INTERVAL_S)


class _Server(uvicorn.Server):
    """uvicorn's server, plus a listener of its own for the probe routes (`probes`), whose
    connections are counted apart from the clients'."""

    def __init__(
        self,
        config: uvicorn.Config,
        probes: socket.socket | None,
        header_timeout_s: float,
        announce: bool,
    ) -> None:
        super().__init__(config)
        self.probes = probes
        self.announce = announce
        self.probe_state = ServerState()
        self.probe_protocol = guarded_protocol(PROBE_CONNECTIONS, header_timeout_s, probes=True)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # (SystemExit when the app did not start)
        if self.probes is not None:
            await self._serve_probes(self.probes)
        settle_runtime()
        if self.announce:
            for sock in sockets or ():  # the port a `--port 0` was given
                host, port = sock.getsockname()[:2]
                log.info("serving on %s:%d", host, port)

    async def _serve_probes(self, sock: socket.socket) -> None:
        def connect() -> asyncio.Protocol:
            return self.probe_protocol(  # type: ignore[call-arg]
                config=self.config, server_state=self.probe_state, app_state=self.lifespan.state
            )

        loop = asyncio.get_running_loop()
        self.servers.append(await loop.create_server(connect, sock=sock, backlog=PROBE_BACKLOG))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for connection in list(self.probe_state.connections):
            connection.shutdown()
        await super().shutdown(sockets)

    async def _wait_tasks_to_complete(self) -> None:
        """uvicorn's wait for the requests in flight, within its graceful timeout, before the
        app's shutdown: the probe listener's too (a readiness check or a scrape answered as
        the app's services were taken down was a 500)."""
        await super()._wait_tasks_to_complete()
        probes = self.probe_state
        # Polled, as uvicorn waits for its own: its server state has no event to wait on.
        while (probes.connections or probes.tasks) and not self.force_exit:  # noqa: ASYNC110
            await asyncio.sleep(0.1)


def guarded_protocol(
    max_connections: int, header_timeout_s: float, probes: bool = False
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a cap on connections, a deadline on headers, and
    bounds on what one connection may make the server hold: a request's head, its trailers,
    the requests pipelined behind it. With `probes`, it serves the probe routes only."""

    class GuardedProtocol(HttpToolsProtocol):
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
            if probes:
                self.app = probe_routes(self.app)
            self._idle_since = self.loop.time()
            if len(self.connections) > max_connections and not (probes and self._make_room()):
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
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


class _UnfinishedOnPurpose(logging.Filter):
    """Drops uvicorn's error for an answer the app left unfinished on purpose, having logged
    why (`CUT_ON_PURPOSE`: an answer cut after it began, a relayed upstream's that failed or
    ran past its step timeout); the server then closes the connection, as it should. Any
    other answer left unfinished is still told."""

    def filter(self, record: logging.LogRecord) -> bool:
        unfinished = record.msg == "ASGI callable returned without completing response."
        return not (unfinished and CUT_ON_PURPOSE.get())


UNFINISHED_ON_PURPOSE = _UnfinishedOnPurpose()


def serve(
    app: ASGIApp,
    server: ServerConfig,
    sock: socket.socket | None = None,
    probes: socket.socket | None = None,
    announce: bool = True,
) -> bool:
    """Serves `app` until the process is told to stop, on `sock` when given (a worker's share
    of the supervisor's socket), else on `server.host` and `server.port`; and its probe routes
    on `probes`, when given. False when it did not start (its lifespan failed: a required MCP
    server did not connect, say). `announce`: log the address once started (a worker does
    not: its supervisor did)."""
    options: dict[str, Any] = {
        "host": server.host,
        "port": server.port,
        "log_level": "warning",
        "access_log": False,
        "proxy_headers": False,  # the client's address is never used: no layer to rewrite it
        "server_header": False,  # `server: uvicorn`: nothing a client needs, checked per answer
        "timeout_graceful_shutdown": 30,
        "timeout_keep_alive": server.keep_alive_timeout_s,
        "http": guarded_protocol(server.connection_limit(), server.header_timeout_s),
        "ws": "none",
    }
    config = uvicorn.Config(app, **options)  # (which sets up uvicorn's loggers)
    logging.getLogger("uvicorn.error").addFilter(UNFINISHED_ON_PURPOSE)  # once: same object
    served = _Server(config, probes, server.header_timeout_s, announce)
    try:
        served.run(sockets=[sock] if sock else None)
    except SystemExit:  # uvicorn's answer to a lifespan that failed: told, and not started
        return False
    return served.started
