"""How the proxy reaches one MCP server: a stdio child or streamable HTTP, through the `mcp`
SDK's own transports, with a watch on the connection's end."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx2
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage

from proxy.config.tools import ToolConfig
from proxy.egress import Egress
from proxy.tools.base import TOOL_KEEPALIVE_S
from proxy.tools.mcp_asked import AnswerWrites, AskedRequests
from proxy.tools.mcp_bounds import BoundedBodies, tell_bounds_in_a_line
from proxy.tools.mcp_exchanges import TimedExchanges
from proxy.tools.mcp_stdio import stdio_client

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
    tell_bounds_in_a_line()
    session = streamable_http_client(cfg.url, http_client=http, max_sse_event_size=limit)
    async with http, session as (read, write):
        yield read, write
