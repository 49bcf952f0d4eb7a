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
from proxy.config import ServerConfig
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
        try:
            deadline = asyncio.get_running_loop().time() + self.body_timeout_s
            await self.app(scope, _body_deadline(receive, deadline, self.body_timeout_s), send)
        finally:
            self.requests -= 1
            self.runs -= run

    @staticmethod
    async def _busy(send: Send, why: str) -> None:
        error = ServerBusy(f"the proxy is busy: {why}; retry later")
        await send_error(send, error, {"retry-after": RETRY_AFTER_S, "connection": "close"})


def _body_deadline(receive: Receive, deadline: float, timeout_s: float) -> Receive:
    """`receive` that raises RequestTimeout (a 408 that closes the connection) when the body
    is not whole by `deadline` (loop time); after the body it waits as long as the route
    likes, for a disconnect."""
    body_done = False

    async def timed_receive() -> Message:
        nonlocal body_done
        if body_done:
            return await receive()
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {timeout_s:g}s (server.body_timeout_s)"
            ) from None
        if message["type"] != "http.request" or not message.get("more_body"):
            body_done = True
        return message

    return timed_receive
