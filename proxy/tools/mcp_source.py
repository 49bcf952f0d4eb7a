"""One MCP server as a source of tools (SPEC §13): its session, held open by a task of its own
from the lifespan's start to its end, reconnected with backoff when it drops, and its tool list,
read at connect and again whenever the server says it changed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import shutil
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal

import anyio
import mcp_types
from mcp import Client
from mcp.client.subscriptions import ListenNotSupportedError, SubscriptionLost
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from proxy.config.tools import ToolConfig
from proxy.redaction import REDACTED, origin, redacted
from proxy.tools.base import ToolFailed
from proxy.tools.mcp_failures import DROPPED_ERRORS, invalid, reason, said, session_gone
from proxy.tools.mcp_schemas import Schemas, checked_listing
from proxy.tools.mcp_transport import (
    CONNECTION_ENDED,
    MAX_HTTP_CALLS,
    Endpoint,
    endpoint,
    open_transport,
    resolve_env,
)

log = logging.getLogger(__name__)

RELIST_INTERVAL_S = 1.0  # the least time between two reads of a changing tool list
FIRST_RETRY_S = 0.5  # the first wait before a reconnect; it doubles up to reconnect_max_s
# A session that lasted this long waits FIRST_RETRY_S again once dropped; a shorter one does
# not (a server dropping each session at once made one, its tools listed, every second).
STEADY_S = 30.0
MAX_LIST_PAGES = 64  # of one tools/list walk
# The tools one walk reads: past them it stops (each is held, named and checked at every change
# of the list; 224,000 tiny ones kept a proxy from answering for minutes).
MAX_LISTED_TOOLS = 10_000
CLOSE_TIMEOUT_S = 10.0  # for a session to end on shutdown (a stdio child gets 4 s to exit)
CLIENT_INFO = mcp_types.Implementation(name="loopwarden", version="1")

State = Literal["connecting", "connected", "disconnected", "closed"]
Listener = Callable[["McpSource"], None]


class McpSource:
    """The session with one configured MCP server. Calls made while it is not connected fail
    at once with a tool error that says so; the tools stay as last listed."""

    def __init__(
        self, name: str, cfg: ToolConfig, max_values: int, env: Mapping[str, str] = os.environ
    ) -> None:
        """`max_values`: the most JSON values a message of the server may hold. Raises
        ValueError when the command's program is not found or a variable of `env_env` or
        `headers_env` is not set: what can be checked without connecting."""
        self.name = name
        self.cfg = cfg
        self.max_values = max_values
        if cfg.command is not None:
            if shutil.which(cfg.command[0], path=env.get("PATH")) is None:
                raise ValueError(f"command: no program {cfg.command[0]!r} (on PATH or as a path)")
            self._secrets = resolve_env(cfg.env_env, env, "env_env")
        else:
            self._secrets = resolve_env(cfg.headers_env, env, "header")
        self.endpoint: Endpoint = endpoint(cfg)
        self.state: State = "disconnected"
        self.error: str | None = None  # why the last attempt failed or the session dropped
        self.tools: tuple[mcp_types.Tool, ...] = ()
        # The schemas of `tools`, checked in a thread as they were read, by tool name.
        self.schemas: dict[str, Schemas | str] = {}
        self.listed = False  # a list was ever read
        self.session_id: str | None = None
        self.listeners: list[Listener] = []
        self._client: Client | None = None
        self._ended: str | None = None  # why the transport ended this attempt, if it knows
        self._dropped = asyncio.Event()
        self._relist = asyncio.Event()
        self._relisted = -math.inf  # when the tools were last listed (`_now`)
        self._connected_at = -math.inf  # when the session last got connected (`_now`)
        self._closing = asyncio.Event()
        self._attempted = asyncio.Event()  # the first connect attempt has ended
        # Calls at once: over HTTP each holds a connection of the session's pool, and one that
        # waits past the pool's timeout fails every call of the session (the SDK's transport
        # ends): the rest wait here, within their own timeout_s.
        self._calls: contextlib.AbstractAsyncContextManager[Any] = (
            contextlib.nullcontext() if cfg.url is None else asyncio.Semaphore(MAX_HTTP_CALLS)
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        """Connected, and no sign yet that the session dropped."""
        return self.state == "connected" and not self._dropped.is_set()

    def describe(self) -> str:
        """The server as a model or a client reads of it: its name alone (its URL or command
        line may hold a token)."""
        return f"MCP server {self.name!r}"

    def located(self) -> str:
        """The server as the proxy's log and `check` name it: its URL's scheme, host and port,
        or its program (no path, query, user or argument: they may hold a token)."""
        if self.cfg.url is not None:
            where = origin(self.cfg.url)
        else:
            where = os.path.basename((self.cfg.command or [""])[0])
        return f"{self.describe()} ({where})"

    def not_connected(self) -> str:
        """Why a call cannot be made now, as its tool error says it."""
        reason = f": {self._told(self.error)}" if self.error else ""
        return f"{self.describe()} is not connected{reason}; retry later"

    def _told(self, reason: str | None) -> str:
        """A reason the session failed, as a client may read it: without the server's URL."""
        told = reason or ""
        for url in (self.cfg.url, (self.cfg.url or "").split("?")[0]):  # whole, then no query
            if url:  # (a piece of it, "https://" or its host, is no secret: kept)
                told = told.replace(url, REDACTED)
        return redacted(told)

    async def start(self) -> None:
        """Starts the session's task; returns when the first attempt to connect has ended
        (within `connect_timeout_s`), connected or not."""
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name=f"mcp:{self.name}")
        await self._attempted.wait()

    async def close(self) -> None:
        """Ends the session (a stdio child is stopped) and stops reconnecting. One still
        connecting is cancelled at once: its handshake may never end (within
        `connect_timeout_s`), and the proxy may exit before its child was stopped."""
        self._closing.set()
        task, self._task = self._task, None
        if task is not None:
            if self.state == "connecting":
                task.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(task), CLOSE_TIMEOUT_S)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            except asyncio.CancelledError:
                if not task.cancelled():  # (this close itself was cancelled)
                    raise
        self.state = "closed"

    async def call(self, tool: str, arguments: dict[str, Any]) -> mcp_types.CallToolResult:
        """`tools/call`; ToolFailed when the server cannot be asked or fails to answer. The SDK
        puts the current span's context in `params._meta.traceparent`."""
        try:
            async with self._calls:
                client = self._client  # the session's now: a call may have waited its turn
                if client is None or not self.connected:
                    raise ToolFailed(self.not_connected())
                return await client.call_tool(tool, arguments)
        except MCPError as exc:
            text = said(exc.error.message)
            if session_gone(exc.error, self.cfg.url is not None):
                cause = self.error if self._dropped.is_set() else None  # why, if known
                self._drop(f"the session dropped during the call: {text}")
                message = f"{self.describe()} dropped the call: {self._told(cause or text)}"
                raise ToolFailed(message) from None
            raise ToolFailed(f"{self.describe()} refused the call: {text}") from None
        except DROPPED_ERRORS as exc:
            self._drop(f"the connection failed during the call: {type(exc).__name__}")
            raise ToolFailed(f"{self.describe()} is unreachable: {type(exc).__name__}") from None
        except ValidationError as exc:
            raise ToolFailed(f"{self.describe()} answered: {invalid(exc)}") from None

    def _drop(self, reason: str) -> None:
        """Ends the session; the first reason given is the one kept."""
        if self.connected and not self._dropped.is_set():
            self.error = reason
            self._dropped.set()

    async def _supervise(self) -> None:
        delay = FIRST_RETRY_S
        while not self._closing.is_set():
            began = _now()
            try:
                await self._session()
            except Exception as exc:  # any failure (to connect, or of the session) is retried
                self.error = self._ended or reason(exc)
            finally:
                self._client = None
                if self.state != "closed":
                    self.state = "disconnected"
                self._attempted.set()
            if self._closing.is_set():
                break
            if self._connected_at >= began:  # it got connected, then dropped
                if _now() - self._connected_at >= STEADY_S:
                    delay = FIRST_RETRY_S  # (a session dropped at once waits longer each time)
                log.warning("%s disconnected: %s; reconnecting", self.located(), self.error)
            else:
                log.warning("%s: cannot connect: %s", self.located(), self.error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), delay)
            delay = min(delay * 2, self.cfg.reconnect_max_s)

    async def _session(self) -> None:
        """One session, from connect to drop or close (`_connected_at` says whether it got
        connected)."""
        self.state = "connecting"
        self._ended = None
        self._dropped.clear()
        self._relist.clear()
        self.session_id = None
        with anyio.CancelScope(deadline=anyio.current_time() + self.cfg.connect_timeout_s) as scope:
            transport = open_transport(
                self.cfg,
                self._secrets,
                self._on_end,
                self._on_session,
                self.max_values,
                self.located(),
            )
            client = Client(
                transport,
                mode="auto",
                cache=None,
                message_handler=self._on_message,
                client_info=CLIENT_INFO,
            )
            async with client, anyio.create_task_group() as group:
                listed = await self._list(client)
                scope.deadline = math.inf  # connected: no deadline but the session's own end
                await self._take(listed)
                self._client = client
                self.state = "connected"
                self._connected_at = _now()
                self.error = None
                self._attempted.set()
                log.info("%s connected: %d tools", self.located(), len(self.tools))
                self._published()
                if _announces_changes(client):
                    group.start_soon(self._listen, client)
                await self._serve(client)
                group.cancel_scope.cancel()
                return
        if scope.cancelled_caught:
            limit = self.cfg.connect_timeout_s
            raise TimeoutError(f"no answer within connect_timeout_s ({limit:g}s)")

    async def _serve(self, client: Client) -> None:
        """Waits for the session's end, re-listing the tools whenever they change: at most once
        every RELIST_INTERVAL_S, the changes announced meanwhile read in one list (a server
        announcing changes every 50 ms made the proxy read its 12 MB list 4 times a second)."""
        while True:
            waits = [self._dropped.wait(), self._closing.wait(), self._relist.wait()]
            await _first(waits)
            if self._dropped.is_set() or self._closing.is_set():
                return
            ended = [self._dropped.wait(), self._closing.wait()]
            await _first([*ended, asyncio.sleep(self._relisted + RELIST_INTERVAL_S - _now())])
            if self._dropped.is_set() or self._closing.is_set():
                return
            self._relist.clear()
            try:
                with anyio.fail_after(self.cfg.connect_timeout_s):
                    listed = await self._list(client)
                await self._take(listed)
            except Exception as exc:
                if self._ended or self._dropped.is_set():  # the session's end: that is why
                    self.error = self._ended or self.error
                    return
                log.warning(  # slow or refused: the calls and the session go on
                    "%s: its changed tool list could not be read again: %s; the tools stay as "
                    "last listed",
                    self.located(),
                    reason(exc),
                )
                continue
            log.info("%s changed its tools: %d tools", self.located(), len(self.tools))
            self._published()

    async def _list(self, client: Client) -> list[mcp_types.Tool]:
        """The server's tools, MAX_LISTED_TOOLS at most."""
        tools: list[mcp_types.Tool] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            page = await client.list_tools(cursor=cursor, cache_mode="bypass")
            room = MAX_LISTED_TOOLS - len(tools)
            tools.extend(page.tools[:room])
            cursor = page.next_cursor
            if len(page.tools) > room or (cursor is not None and len(tools) == MAX_LISTED_TOOLS):
                log.warning(
                    "%s lists more than %d tools: the rest are not read",
                    self.located(),
                    MAX_LISTED_TOOLS,
                )
                break
            if cursor is None:
                break
        # The tools' output schemas are checked by their tools (`mcp_tool`), off the event
        # loop and bounded: the SDK, which would check them on it, is given none.
        schemas = getattr(client.session, "_tool_output_schemas", None)
        if isinstance(schemas, dict):
            schemas.update(dict.fromkeys((tool.name for tool in tools), None))
        else:  # an `mcp` whose session keeps them otherwise: it checks them too, on the loop
            log.warning("the mcp SDK's output schemas were not found: it checks results too")
        return tools

    async def _take(self, tools: list[mcp_types.Tool]) -> None:
        """`tools` as the source's, with the schemas of those it may expose checked in a
        thread (seconds for a large list: after the connect deadline, off the event loop)."""
        cfg = self.cfg
        self.schemas = await asyncio.to_thread(
            checked_listing, tools, lambda name: cfg.exposed_name(name) is not None, cfg.max_tools
        )
        self.tools = tuple(tools)
        self.listed = True
        self._relisted = _now()

    async def _listen(self, client: Client) -> None:
        """A 2026-era server sends its change events on a `subscriptions/listen` stream; the
        stream's loss is the session's."""
        try:
            async with client.listen(tools_list_changed=True) as events:
                async for _ in events:
                    self._relist.set()
        except (SubscriptionLost, MCPError, *DROPPED_ERRORS) as exc:
            self._drop(f"the server's event stream ended: {reason(exc)}")
            return
        except ListenNotSupportedError:
            return
        self._drop("the server closed its event stream")

    async def _on_message(self, message: Any) -> None:
        # A handshake-era server's `notifications/tools/list_changed`.
        if isinstance(message, mcp_types.ToolListChangedNotification):
            self._relist.set()

    def _on_end(self, reason: str) -> None:
        if self._ended is None and reason != CONNECTION_ENDED:
            self._ended = reason  # a message over a bound, while connecting too
        self._drop(reason)

    def _on_session(self, session_id: str) -> None:
        self.session_id = session_id

    def _published(self) -> None:
        for listener in list(self.listeners):
            try:
                listener(self)
            except Exception:
                log.exception("a listener of %s failed", self.located())


def _announces_changes(client: Client) -> bool:
    """The server is of the 2026 era and says its tool list may change."""
    if client.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False
    tools = client.server_capabilities.tools
    return bool(tools and tools.list_changed)


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _first(waits: Sequence[Awaitable[Any]]) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
