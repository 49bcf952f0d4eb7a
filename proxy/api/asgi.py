"""Raw ASGI: reading bodies, sending JSON and OpenAI-shaped errors with no per-call overhead,
and the boundary that renders every error of every route."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.engine.run_spec import RunResult
from proxy.errors import (
    BodyTooLarge,
    ClientDisconnected,
    InternalError,
    ProxyError,
    ShuttingDown,
    ShuttingDownActed,
    UnsupportedEncoding,
)
from proxy.telemetry.http import CUT_ON_PURPOSE

log = logging.getLogger(__name__)
T = TypeVar("T")

# Set in a request's task as its run ends: what the drain's end says of a request it stops
# while the answer is made.
RUN_ENDED: ContextVar[RunResult | None] = ContextVar("loopwarden_run_ended", default=None)

JSON = b"application/json"
# How long a run goes before a task watches for its client's disconnect: a task per request
# costs more than many a whole run against a fast upstream, and a client that left within
# this time still stops its run, this much later.
WATCH_AFTER_S = 0.05


class Shutdown:
    """Whether the server has begun to shut down (SIGTERM), and whether its drain ended
    (`server.shutdown_timeout_s`): from then on, a request's task that is cancelled was
    stopped by the drain's end, not by its client, and is answered `ShuttingDown` when its
    answer has not begun."""

    __slots__ = ("begun", "ended")

    def __init__(self) -> None:
        self.begun = False
        self.ended = False

    def begin(self) -> None:
        self.begun = True

    def end(self) -> None:
        """The drain ended: the requests still going are cancelled next."""
        self.begun = self.ended = True

    def stopped(self, task: asyncio.Task[Any] | None) -> bool:
        """`task`, cancelled, was stopped by the drain's end: it is no longer cancelled then,
        and goes on to answer."""
        return self.ended and task is not None and task.uncancel() == 0


def shutting_down(ended: RunResult | None, running: bool = False) -> ShuttingDown:
    """The drain's end, told to a request whose run is `running` (its result so far: `ended`),
    had ended (`ended`), or that had none: not to be sent again as it was once tools ran."""
    error = ShuttingDownActed if ended is not None and ended.tools_ran else ShuttingDown
    if running:
        return error()
    if ended is None:
        return error("the server shut down before the request was answered")
    return error("the server shut down before the run's answer was sent")


def header_list(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def send_json(
    send: Send, status: int, body: Any, headers: dict[str, str] | None = None
) -> None:
    content = orjson.dumps(body)
    await send_bytes(send, status, content, JSON, headers)


async def send_bytes(
    send: Send,
    status: int,
    content: bytes,
    content_type: bytes,
    headers: dict[str, str] | None = None,
) -> None:
    raw = [(b"content-type", content_type), (b"content-length", str(len(content)).encode())]
    if headers:
        raw.extend(header_list(headers))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content})


async def send_error(
    send: Send,
    error: ProxyError,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    body = error.body()
    if extra:
        body.update(extra)
    await send_json(send, error.status, body, headers)


async def read_body(receive: Receive, scope: Scope, limit: int) -> bytes:
    """A request's JSON body, refused when larger than `limit` (413) or compressed (415: read as
    plain, it would be "not valid JSON")."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise BodyTooLarge(f"the body is larger than {limit} bytes")
        if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            raise UnsupportedEncoding(
                f"content-encoding {value[:32].decode('latin-1')!r} is not supported: send the "
                "body uncompressed",
                param="content-encoding",
            )
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected("client went away before sending its body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the body is larger than {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_or_cancel(run: Callable[[], Awaitable[T]], receive: Receive) -> T | None:
    """Runs to the end in this task, or cancels the run when the client goes away (returns
    None). The client is watched once the run has lasted WATCH_AFTER_S: a disconnect before
    then is seen then, and a run that ends sooner costs no watching at all."""
    task = asyncio.current_task()
    assert task is not None
    watch = _Watch(task, receive)
    try:
        return await run()
    except asyncio.CancelledError:
        if watch.gone and task.uncancel() == 0:
            return None
        raise
    finally:
        watch.stop()


class _Watch:
    """One task that waits for the client's disconnect, started by a timer, and cancels the
    run's `task` if the run is still going."""

    __slots__ = ("gone", "receive", "task", "timer", "watcher")

    def __init__(self, task: asyncio.Task[Any], receive: Receive) -> None:
        self.task: asyncio.Task[Any] | None = task
        self.receive = receive
        self.gone = False
        self.watcher: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            WATCH_AFTER_S, self._start
        )

    def _start(self) -> None:
        self.timer = None
        self.watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        await until_disconnect(self.receive)
        if self.task is not None:  # else the run ended first, and its task has moved on
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        """The run ended: nothing to watch any more."""
        self.task = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None


def bearer_token(scope: Scope) -> str | None:
    """The token of the request's `Authorization: Bearer …` header, parsed once per request."""
    value = header(scope, b"authorization")
    if value is None or not value.lower().startswith("bearer "):
        return None
    return value[7:].strip() or None


class ErrorBoundary:
    """Every error a route raises or lets escape becomes an OpenAI-shaped response: a
    `ProxyError` as itself, anything else as a logged 500 `internal_error`. Once a response
    has started, nothing more can be said and the error is only logged."""

    def __init__(self, app: ASGIApp, shutdown: Shutdown) -> None:
        self.app = app
        self.shutdown = shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnected:
            return
        except asyncio.CancelledError:
            if not self.shutdown.stopped(asyncio.current_task()):
                raise
            await self._told(scope, send, shutting_down(RUN_ENDED.get()), started)
        except ProxyError as exc:
            await self._told(scope, send, exc, started)
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                await send_error(send, InternalError())
            else:
                CUT_ON_PURPOSE.set(True)  # (told above, traceback and all)

    @staticmethod
    async def _told(scope: Scope, send: Send, exc: ProxyError, started: bool) -> None:
        if not started:
            await send_error(send, exc, exc.headers or None)
        else:  # the server closes the connection: the client sees an answer cut short
            log.warning("%s %s cut short: %s", scope.get("method"), scope.get("path"), exc)
            CUT_ON_PURPOSE.set(True)
