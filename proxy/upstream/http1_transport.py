"""The upstreams' transport: HTTP/1.1 over the event loop's own connections (TLS for `https`),
answers parsed by httptools, kept-alive connections reused, most recently freed first.

A request costs a head written in one piece and a parse in C: against aiohttp's client, whose
request and response objects cost several times our whole request, this is what a relay needs
and no more (no cookies, redirects or decompression: the proxy asks for `identity` and relays
what comes). A web proxy the environment names is used (`egress`).
"""

from __future__ import annotations

import asyncio
import collections
import re
import ssl
import time
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from proxy.deadline import within
from proxy.egress import Egress
from proxy.upstream.http1_connection import (
    Answer,
    Broken,
    Connection,
    ConnectTimeout,
    NotHttp,
    ReadTimeout,
    Unreachable,
)
from proxy.upstream.transport import Body, Failure, Headers, Timeouts
from proxy.upstream.tunnel import tunnel

URL_CACHE = 1024  # parsed URLs kept: a run's upstream URL is parsed once, not per call
SENDS_A_BODY = frozenset({"POST", "PUT", "PATCH"})  # a length of 0 is said when it has none
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})
# How soon after a request went out on a kept-alive connection the connection's end may come,
# without a byte of answer, to be the upstream closing it as idle as the request crossed
# (a round trip, and the loop's delay in reading it); later, it may have taken the request.
CROSSED_S = 0.5
_SPACE_OR_CONTROL = re.compile("[\x00-\x20\x7f]")


@dataclass(frozen=True, slots=True)
class _Target:
    origin: tuple[str, str, int]  # scheme, host, port: the connections it may use
    start: str  # the request line after its method, and the Host field


class Http1Transport:
    """At most `connections` connections open (idle ones count; the oldest idle one is closed
    to open another); idle ones are kept `keepalive_s`."""

    def __init__(
        self, connections: int = 1000, keepalive_s: float = 60.0, egress: Egress | None = None
    ) -> None:
        self.connections = connections
        self.egress = egress or Egress()
        self.keepalive_s = keepalive_s
        self._open: set[Connection] = set()
        self._connecting = 0
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._targets: dict[str, _Target] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    async def send(
        self, method: str, url: str, headers: Headers, body: Body, timeouts: Timeouts
    ) -> Answer:
        target = self._target(url)
        head = _head(method, target, headers, body)
        connection = await self._connection(target.origin, timeouts.connect_s)
        sent = time.monotonic()
        try:
            answer = await _exchange(connection, head, body, timeouts.read_s)
        except Broken:
            if not self._crossed(connection, sent) or not _resendable(method, body):
                raise
            connection = await self._connection(target.origin, timeouts.connect_s, idle=False)
            answer = await _exchange(connection, head, body, timeouts.read_s)
        if method == "HEAD":
            answer.end_head()
        return answer

    def failure(self, exc: BaseException) -> Failure | None:
        if isinstance(exc, ReadTimeout):
            return Failure.TIMEOUT
        if isinstance(exc, NotHttp):
            return Failure.NOT_HTTP
        if isinstance(exc, Broken):
            return Failure.BROKEN
        if isinstance(exc, ConnectTimeout):
            return Failure.CONNECT_TIMEOUT
        if isinstance(exc, Unreachable):
            return Failure.UNREACHABLE
        return None

    def _crossed(self, connection: Connection, sent: float) -> bool:
        """Whether a request a connection's end answered met the upstream closing it as idle
        (its idle timeout and this reuse crossed): the connection was kept alive, its end came
        without a byte of answer and at once (the upstream did not take the request, work on it
        and fail), and not because the proxy closed it."""
        return (
            connection.reused
            and not connection.heard
            and time.monotonic() - sent <= CROSSED_S
            and not self._closed
        )

    async def aclose(self) -> None:
        self._closed = True
        for connection in list(self._open):
            connection.close()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    # -- the pool

    async def _connection(
        self, origin: tuple[str, str, int], connect_s: float, idle: bool = True
    ) -> Connection:
        """A connection to `origin`: the one freed last, or (and without `idle`) a new one."""
        while True:
            kept = self._idle.get(origin) if idle else None
            while kept:
                connection = kept.pop()
                if not connection.lost:
                    return connection
            if len(self._open) + self._connecting < self.connections:
                return await self._connect(origin, connect_s)
            if not self._close_oldest_idle():
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                try:
                    await waiter
                except asyncio.CancelledError:
                    if waiter.done() and not waiter.cancelled():
                        self._wake_one()  # woken, then cancelled: the next one may go
                    raise
                finally:
                    if not waiter.done():
                        waiter.cancel()

    async def _connect(self, origin: tuple[str, str, int], connect_s: float) -> Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        self._connecting += 1
        try:
            if scheme == "https" and (proxy := self.egress.proxy_for(scheme, host)) is not None:
                started = time.monotonic()
                sock = await tunnel(proxy, host, port, connect_s)
                connect_s -= time.monotonic() - started
                made = loop.create_connection(
                    lambda: Connection(origin, self._free, self._lost),
                    sock=sock,
                    ssl=self._tls_context(),
                    server_hostname=host,
                )
            else:
                made = loop.create_connection(
                    lambda: Connection(origin, self._free, self._lost),
                    host,
                    port,
                    ssl=self._tls_context() if scheme == "https" else None,
                )
            _, connection = await within(made, connect_s)  # (a cancel as it connects raised)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {host}:{port} within {connect_s:g} s") from None
        except OSError as exc:
            raise Unreachable(f"cannot connect to {host}:{port} ({exc})") from None
        finally:
            self._connecting -= 1
        self._open.add(connection)
        return connection

    def _free(self, connection: Connection) -> None:
        connection.idle_since = time.monotonic()
        connection.reused = True  # from its next request on
        self._idle.setdefault(connection.origin, []).append(connection)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s, self._expire)
        self._wake_one()

    def _lost(self, connection: Connection) -> None:
        self._open.discard(connection)
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _close_oldest_idle(self) -> bool:
        oldest: Connection | None = None
        for idle in self._idle.values():
            for connection in idle:
                if connection.lost:
                    continue
                if oldest is None or connection.idle_since < oldest.idle_since:
                    oldest = connection
        if oldest is None:
            return False
        oldest.close()
        return True

    def _expire(self) -> None:
        """Closes the connections idle for `keepalive_s`; comes back while any are idle."""
        self._sweep = None
        since = time.monotonic() - self.keepalive_s
        for origin, idle in list(self._idle.items()):
            kept = []
            for connection in idle:
                if connection.lost:
                    continue
                if connection.idle_since <= since:
                    connection.close()
                else:
                    kept.append(connection)
            if kept:
                self._idle[origin] = kept
            else:
                del self._idle[origin]
        if self._idle:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s, self._expire)

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= URL_CACHE:
                self._targets.clear()
            target = self._targets[url] = _parse(url, self.egress)
        return target


def _parse(url: str, egress: Egress) -> _Target:
    """The URL as given (a percent-encoded `/` in a relayed id stays encoded); an http URL
    whole in the request line, to the proxy that `egress` names for it."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    authority = parts.netloc.rpartition("@")[2]
    if _unsafe(path) or _unsafe(authority):
        raise ValueError(f"the URL has a space or control character: {url!r}")
    proxy = egress.proxy_for(scheme, parts.hostname) if scheme == "http" else None
    if proxy is None:
        return _Target((scheme, parts.hostname, port), f" {path} HTTP/1.1\r\nhost: {authority}\r\n")
    start = f" http://{authority}{path} HTTP/1.1\r\nhost: {authority}\r\n"
    if proxy.authorization is not None:
        start += f"proxy-authorization: {proxy.authorization}\r\n"
    return _Target(("http", proxy.host, proxy.port), start)


def _unsafe(text: str) -> bool:
    """A space or control character: what would end or split a request line or field name."""
    return _SPACE_OR_CONTROL.search(text) is not None


def _head(method: str, target: _Target, headers: Headers, body: Body) -> bytes:
    items = headers.items() if isinstance(headers, Mapping) else headers
    lines = [method, target.start]
    for name, value in items:
        if "\n" in value or "\r" in value or _unsafe(name):
            raise ValueError(f"header {name!r} has a line break or is not a field name")
        lines.append(f"{name}: {value}\r\n")
    if isinstance(body, bytes):
        lines.append(f"content-length: {len(body)}\r\n")
    elif body is not None:
        lines.append("transfer-encoding: chunked\r\n")
    elif method in SENDS_A_BODY:
        lines.append("content-length: 0\r\n")
    lines.append("\r\n")
    text = "".join(lines)
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")


async def _exchange(connection: Connection, head: bytes, body: Body, read_s: float) -> Answer:
    """Sends one request on `connection` and waits for its answer's head."""
    answer = connection.answer = Answer(connection, read_s)
    connection.heard = False
    try:
        if body is None or isinstance(body, bytes):
            connection.write([head, body] if body else [head])
        else:
            await _send_chunked(connection, head, body)
        await answer.head()
    except BaseException:
        connection.close()  # mid-request: it cannot carry another
        raise
    return answer


def _resendable(method: str, body: Body) -> bool:
    """A request the upstream did not take may go again, as browsers resend one: one whose
    body is whole in hand (the upstream calls of runs), or an idempotent one without a body. A
    streamed body cannot be sent again, and a relayed request is sent once."""
    return isinstance(body, bytes) or (body is None and method in IDEMPOTENT)


async def _send_chunked(connection: Connection, head: bytes, body: AsyncIterable[bytes]) -> None:
    connection.write([head])
    async for chunk in body:
        if chunk:
            connection.write([b"%x\r\n" % len(chunk), chunk, b"\r\n"])
            await connection.drain()
    connection.write([b"0\r\n\r\n"])
