"""The HTTP server: uvicorn, with bounds on what a client connection may hold.

- At most `server.connection_limit()` client connections: one more is answered 503 and closed
  as it arrives, so that client connections never take the descriptors that upstream, tool and
  state connections need (the default is derived from RLIMIT_NOFILE).
- A request's line and headers must arrive within `server.header_timeout_s` of the connection
  (or of the request's first byte, on a kept-alive connection), else the connection is closed;
  a head longer than MAX_HEAD_BYTES is answered 431 and its connection closed (as soon as that
  many bytes of it came, when it comes in more than one read). These are the connections'
  protocol's (`proxy.api.guarded_protocol`); the interpreter's settings `proxy.api.runtime`'s.
- An idle kept-alive connection is closed after `server.keep_alive_timeout_s`.
- With `server.probe_port`, a second listener serves the probe routes only (/healthz, /readyz,
  /metrics) with connections of its own, so that a client holding every connection of the
  proxy's port does not make the pod look dead.
- The body deadline (`server.body_timeout_s`) and the cap on requests in flight are the app's
  (`proxy.api.admission`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.server import ServerState

from proxy.api.asgi import Shutdown
from proxy.api.guarded_protocol import guarded_protocol
from proxy.api.runtime import settle_runtime
from proxy.config.server import ServerConfig, raise_descriptor_limit
from proxy.telemetry.http import CUT_ON_PURPOSE
from proxy.throttled_log import ThrottledWarnings

log = logging.getLogger(__name__)

# The probe listener (`server.probe_port`): the connections it holds at once (a kubelet and a
# scraper or two need a few; past it, the longest idle one is closed), and its queue of
# connections not yet accepted.
PROBE_CONNECTIONS = 32
PROBE_BACKLOG = 64
# What the requests the drain's end stopped get to let go of what they hold, before the app's
# services are closed.
SETTLE_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server, plus a listener of its own for the probe routes (`probes`), whose
    connections are counted apart from the clients'."""

    def __init__(
        self,
        config: uvicorn.Config,
        probes: socket.socket | None,
        header_timeout_s: float,
        announce: bool,
        shutdown: Shutdown | None,
    ) -> None:
        super().__init__(config)
        self.probes = probes
        self.app_shutdown = shutdown
        self.announce = announce
        self.probe_state = ServerState()
        self.probe_protocol = guarded_protocol(PROBE_CONNECTIONS, header_timeout_s, probes=True)
        self.probe_server: asyncio.Server | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # (SystemExit when the app did not start)
        self.lifespan = _AfterStopped(
            self.lifespan,
            lambda: [*self.server_state.tasks, *self.probe_state.tasks],
            self._close_probes,
        )
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
        self.probe_server = await loop.create_server(connect, sock=sock, backlog=PROBE_BACKLOG)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's: no new connections, the requests in flight given the graceful timeout
        (`server.shutdown_timeout_s`), then those left cancelled, which the app, told first,
        answers `shutting_down`. The probe listener serves on through the drain (a scrape
        then counts the runs that end during it: none did once the signal came), and is
        closed after."""
        if self.app_shutdown is not None:
            self.app_shutdown.begin()
            if self.config.timeout_graceful_shutdown == 0:  # (no wait runs to be cut short)
                self.app_shutdown.end()
        running = sum(not task.done() for task in self.server_state.tasks)
        log.info(
            "shutting down: %d request%s in flight get %g s to end (server.shutdown_timeout_s)",
            running,
            "" if running == 1 else "s",
            self.config.timeout_graceful_shutdown,
        )
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's: a second SIGINT forces the exit, and every request still going is
        cancelled at once: the drain has ended for them."""
        super().handle_exit(sig, frame)
        if self.force_exit and self.app_shutdown is not None:
            self.app_shutdown.end()

    def _close_probes(self) -> None:
        """The probe listener closed, and its connections told to end after their answer."""
        if self.probe_server is not None:
            self.probe_server.close()
            self.probe_server = None
            for connection in list(self.probe_state.connections):
                connection.shutdown()

    async def _wait_tasks_to_complete(self) -> None:
        """uvicorn's wait for the requests in flight, within its graceful timeout, before the
        app's shutdown; then the probe listener's (a readiness check or a scrape answered as
        the app's services were taken down was a 500)."""
        try:
            await super()._wait_tasks_to_complete()
        except asyncio.CancelledError:  # uvicorn's graceful timeout: it cancels the requests next
            if self.app_shutdown is not None:
                self.app_shutdown.end()
            raise
        self._close_probes()
        probes = self.probe_state
        # Polled, as uvicorn waits for its own: its server state has no event to wait on.
        while (probes.connections or probes.tasks) and not self.force_exit:  # noqa: ASYNC110
            await asyncio.sleep(0.1)


class _AfterStopped:
    """The app's lifespan, whose shutdown first gives the requests the drain's end cancelled
    SETTLE_S to finish (their answer, the context locks and reservations they let go of):
    uvicorn goes straight on from cancelling them to the lifespan's shutdown, which closes the
    state store under them, and the process ends (a `/chat` run's lock was kept for its whole
    lease, its client sent no answer)."""

    def __init__(
        self,
        lifespan: Any,
        requests: Callable[[], list[asyncio.Task[Any]]],
        close_probes: Callable[[], None],
    ) -> None:
        self.lifespan = lifespan
        self.requests = requests
        self.close_probes = close_probes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lifespan, name)

    async def shutdown(self) -> None:
        self.close_probes()  # (the drain's end came: they were not closed after it)
        stopped = [task for task in self.requests() if not task.done()]
        if stopped:
            await asyncio.wait(stopped, timeout=SETTLE_S)
        await self.lifespan.shutdown()


class _UnfinishedOnPurpose(logging.Filter):
    """Drops uvicorn's error for an answer the app left unfinished on purpose, having logged
    why (`CUT_ON_PURPOSE`: an answer cut after it began, a relayed upstream's that failed or
    ran past its step timeout); the server then closes the connection, as it should. Any
    other answer left unfinished is still told."""

    def filter(self, record: logging.LogRecord) -> bool:
        unfinished = record.msg == "ASGI callable returned without completing response."
        return not (unfinished and CUT_ON_PURPOSE.get())


UNFINISHED_ON_PURPOSE = _UnfinishedOnPurpose()


class _UnreadOnceASecond(logging.Filter):
    """uvicorn tells each request it cannot read (`Invalid HTTP request received.`, with its
    traceback): a client sending garbage made a line a request. Told once a second, with the
    count of those not told since."""

    MESSAGE = "Invalid HTTP request received."

    def __init__(self) -> None:
        super().__init__()
        self.throttle = ThrottledWarnings(log)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.MESSAGE:
            return True
        if not self.throttle.due():
            return False
        record.msg = self.MESSAGE + self.throttle.told()
        return True


UNREAD_ONCE_A_SECOND = _UnreadOnceASecond()


class _DrainEndTold(logging.Filter):
    """uvicorn tells the drain's end as an error in its own format; it is a configured end
    (`server.shutdown_timeout_s`): told as a warning of the proxy's, saying what the stopped
    requests are answered."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Cancel %s running task(s), timeout graceful"):
            return True
        log.warning(
            "the drain ended (server.shutdown_timeout_s): %s request(s) still going stopped, "
            "answered 503 shutting_down (a stream that began: its failure event, or cut if "
            "its run had ended)",
            *record.args if isinstance(record.args, tuple) else (),
        )
        return False


DRAIN_END_TOLD = _DrainEndTold()


def serve(
    app: ASGIApp,
    server: ServerConfig,
    sock: socket.socket | None = None,
    probes: socket.socket | None = None,
    announce: bool = True,
    shutdown: Shutdown | None = None,
) -> bool:
    """Serves `app` until the process is told to stop, on `sock` when given (a worker's share
    of the supervisor's socket), else on `server.host` and `server.port`; and its probe routes
    on `probes`, when given. False when it did not start (its lifespan failed: a required MCP
    server did not connect, say). `announce`: log the address once started (a worker does
    not: its supervisor did); `shutdown`, the app's, is told as the server begins to shut down
    and as its drain ends."""
    raise_descriptor_limit()  # (before the connection limit is read of it)
    options: dict[str, Any] = {
        "host": server.host,
        "port": server.port,
        "log_level": "warning",
        "access_log": False,
        "proxy_headers": False,  # the client's address is never used: no layer to rewrite it
        "server_header": False,  # `server: uvicorn`: nothing a client needs, checked per answer
        "timeout_graceful_shutdown": server.shutdown_timeout_s,
        "timeout_keep_alive": server.keep_alive_timeout_s,
        "http": guarded_protocol(server.connection_limit(), server.header_timeout_s),
        "ws": "none",
    }
    config = uvicorn.Config(app, **options)  # (which sets up uvicorn's loggers)
    for told in (UNFINISHED_ON_PURPOSE, UNREAD_ONCE_A_SECOND, DRAIN_END_TOLD):
        logging.getLogger("uvicorn.error").addFilter(told)  # once: the same objects
    served = _Server(config, probes, server.header_timeout_s, announce, shutdown)
    try:
        served.run(sockets=[sock] if sock else None)
    except SystemExit:  # uvicorn's answer to a lifespan that failed: told, and not started
        return False
    except KeyboardInterrupt:  # SIGINT (Ctrl-C), raised again by uvicorn once it has shut down
        pass
    return served.started
