"""The HTTP server: uvicorn, with bounds on what a client connection may hold.

- At most `server.connection_limit()` client connections: one more is answered 503 and closed
  as it arrives, so that client connections never take the descriptors that upstream, tool and
  state connections need (the default is derived from RLIMIT_NOFILE).
- A request's line and headers must arrive within `server.header_timeout_s` of the connection
  (or of the request's first byte, on a kept-alive connection), else the connection is closed.
- An idle kept-alive connection is closed after `server.keep_alive_timeout_s`.
- The body deadline (`server.body_timeout_s`) and the cap on requests in flight are the app's
  (`proxy.api.admission`).
"""

from __future__ import annotations

import asyncio
import gc
import socket
import sys
from typing import Any

import orjson
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.config.server import ServerConfig
from proxy.errors import ServerBusy


def _refusal() -> bytes:
    body = orjson.dumps(ServerBusy("the proxy has too many connections open; retry later").body())
    head = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    return head + body


REFUSED = _refusal()  # what a connection past the limit gets before it is closed

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
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        settle_runtime()


def guarded_protocol(max_connections: int, header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a cap on connections and a deadline on headers."""

    class GuardedProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(REFUSED)
                transport.close()
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()

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


def serve(
    app: ASGIApp, server: ServerConfig, host: str, port: int, sock: socket.socket | None = None
) -> bool:
    """Serves `app` until the process is told to stop, on `sock` when given (a worker's share
    of the supervisor's socket), else on host:port. False when it did not start (its lifespan
    failed: a required MCP server did not connect, say)."""
    options: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": "warning",
        "access_log": False,
        "proxy_headers": False,  # the client's address is never used: no layer to rewrite it
        "timeout_graceful_shutdown": 30,
        "timeout_keep_alive": server.keep_alive_timeout_s,
        "http": guarded_protocol(server.connection_limit(), server.header_timeout_s),
    }
    served = _Server(uvicorn.Config(app, **options))
    served.run(sockets=[sock] if sock else None)
    return served.started
