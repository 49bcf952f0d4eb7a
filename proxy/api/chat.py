"""`POST /v1/chat/completions` as a raw ASGI app: read, resolve, run, render."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from starlette.types import Message, Receive, Scope, Send

from proxy.api.chat_request import ChatRequest, parse_chat_request
from proxy.api.gateway import Gateway
from proxy.api.report import (
    completion_body,
    completion_id,
    failed,
    failure_error,
    loop_report,
    send_failure,
)
from proxy.api.responses import send_error, send_json
from proxy.api.sse import SSEWriter
from proxy.engine.run import Run, RunResult
from proxy.engine.stop import StopReason
from proxy.errors import (
    BodyTooLarge,
    ClientDisconnected,
    InternalError,
    ProxyError,
)

log = logging.getLogger(__name__)

THREAD_HEADER = b"x-loopwarden-thread-id"


async def read_body(receive: Receive, scope: Scope, limit: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise BodyTooLarge(f"the body is larger than {limit} bytes")
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


async def run_or_cancel(
    run: Callable[[], Awaitable[RunResult]], receive: Receive
) -> RunResult | None:
    """Runs to the end, or cancels the run when the client goes away (returns None)."""
    task = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


class ChatCompletions:
    def __init__(self, gateway: Callable[[], Gateway]) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._handle(scope, receive, tracking_send)
        except Exception:
            log.exception("chat completion failed")
            if not started:
                await send_error(send, InternalError())

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gateway()
        try:
            caller = gw.keys.caller(header(scope, b"authorization"))
            raw = await read_body(receive, scope, gw.config.server.max_body_bytes)
            req = parse_chat_request(raw)
            resolved = gw.resolver.resolve(req, header(scope, THREAD_HEADER))
            gw.keys.check(caller, resolved.agent or req.model)
        except ClientDisconnected:
            return
        except ProxyError as exc:
            await send_error(send, exc)
            return
        deps = gw.deps(resolved.upstream, header(scope, b"authorization"))
        spec = resolved.spec
        headers = {"x-loopwarden-run-id": spec.run_id}
        if req.stream:
            writer = SSEWriter(
                send, completion_id(spec.run_id), spec.model, headers, req.loop.include_loop_events
            )
            await self._stream(Run(spec, deps, writer), writer, req, receive, send, gw)
            return
        result = await run_or_cancel(Run(spec, deps).execute, receive)
        if result is None:
            return
        headers["x-loopwarden-stop-reason"] = result.stop.reason.value
        report = loop_report(result, req.loop.include_messages)
        if failed(result):
            await send_failure(send, result, report, headers)
            return
        passthrough = not spec.policy.tools and not req.has_loop
        await send_json(
            send, 200, completion_body(result, spec.model, report, passthrough), headers
        )

    async def _stream(
        self,
        run: Run,
        writer: SSEWriter,
        req: ChatRequest,
        receive: Receive,
        send: Send,
        gw: Gateway,
    ) -> None:
        keepalive = asyncio.ensure_future(writer.keepalive(gw.config.server.keepalive_interval_s))
        try:
            result = await run_or_cancel(run.execute, receive)
        finally:
            keepalive.cancel()
        if result is None or result.stop.reason is StopReason.CANCELLED:
            return
        writer.headers["x-loopwarden-stop-reason"] = result.stop.reason.value
        report = loop_report(result, req.loop.include_messages)
        try:
            if failed(result):
                if not writer.started:
                    await send_failure(send, result, report, writer.headers)
                    return
                await writer.fail(failure_error(result).body(), report)
                return
            if result.stop.reason is StopReason.CLIENT_TOOL_CALL:
                await writer.tool_calls(result.message.get("tool_calls") or [])
            elif not writer.started:
                await writer.content(result.message.get("content") or "")
            usage = result.usage.to_openai() if req.include_usage else None
            await writer.finish(result.finish_reason, report, usage)
        except ClientDisconnected:
            return
