"""Admission: the bounds a request meets before any route sees it.

- Requests in flight (health probes aside) are capped a little below the connection limit, and
  runs in flight at `server.max_concurrent_runs`: past either, a request is answered at once
  with 503 `server_busy`, `Retry-After` and `Connection: close`, so that slow or stuck clients
  cannot hold every connection and `/healthz` and `/readyz` always find room.
- The request body must arrive whole within `server.body_timeout_s` of the request's start: a
  client that sends half a body gets 408 `request_timeout` and its connection is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.api.asgi import send_error
from proxy.config.server import ServerConfig
from proxy.errors import RequestTimeout, ServerBusy

PROBES = frozenset({"/healthz", "/readyz", "/metrics"})  # never refused, never counted
RETRY_AFTER_S = "1"


class Admission:
    def __init__(self, app: ASGIApp, server: ServerConfig, run_paths: Collection[str]) -> None:
        self.app = app
        self.run_paths = frozenset(run_paths)
        self.max_requests = server.request_limit()
        self.max_runs = server.max_concurrent_runs
        self.body_timeout_s = server.body_timeout_s
        self.requests = 0
        self.runs = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        run = scope["method"] == "POST" and scope["path"] in self.run_paths
        if self.requests >= self.max_requests:
            await self._busy(send, f"{self.max_requests} requests are in flight")
            return
        if run and self.runs >= self.max_runs:
            await self._busy(
                send, f"{self.max_runs} runs are in flight (server.max_concurrent_runs)"
            )
            return
        self.requests += 1
        self.runs += run
        body = _BodyDeadline(receive, self.body_timeout_s)
        try:
            await self.app(scope, body.receive, send)
        finally:
            body.disarm()
            self.requests -= 1
            self.runs -= run

    @staticmethod
    async def _busy(send: Send, why: str) -> None:
        error = ServerBusy(f"the proxy is busy: {why}; retry later")
        await send_error(send, error, {"retry-after": RETRY_AFTER_S, "connection": "close"})


class _BodyDeadline:
    """`receive` that raises RequestTimeout (a 408 that closes the connection) when the body is
    not whole `timeout_s` after the request started; after the body it waits as long as the
    route likes, for a disconnect. One timer per request: it cancels a `receive` still waiting
    for the body when it fires, and is disarmed as soon as the body is whole."""

    __slots__ = ("_late", "_receive", "_timeout_s", "_timer", "_waiting")

    def __init__(self, receive: Receive, timeout_s: float) -> None:
        self._receive = receive
        self._timeout_s = timeout_s
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            timeout_s, self._fire
        )
        self._waiting: asyncio.Task[object] | None = None
        self._late = False

    def _fire(self) -> None:
        self._timer = None
        self._late = True
        if self._waiting is not None:
            self._waiting.cancel()

    def expired(self) -> bool:
        return self._late

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def receive(self) -> Message:
        if self._timer is None and not self._late:  # the body is whole
            return await self._receive()
        if self._late:
            raise self._timed_out()
        self._waiting = task = asyncio.current_task()
        try:
            message = await self._receive()
        except asyncio.CancelledError:
            if self.expired() and task is not None and task.uncancel() == 0:
                raise self._timed_out() from None
            raise
        finally:
            self._waiting = None
        if message["type"] != "http.request" or not message.get("more_body"):
            self.disarm()
        return message

    def _timed_out(self) -> RequestTimeout:
        return RequestTimeout(
            f"the request body did not arrive within {self._timeout_s:g}s (server.body_timeout_s)"
        )
