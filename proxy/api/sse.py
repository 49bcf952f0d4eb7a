"""The streaming side of a run: `chat.completion.chunk` SSE written straight to ASGI `send`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson
from starlette.types import Send

from proxy.api.asgi import header_list
from proxy.engine import events as ev
from proxy.errors import ClientDisconnected

KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


class SSEWriter:
    """Implements the engine's `RunStream`. The response starts with the first byte sent, so
    a run that fails before then still gets a plain HTTP error; `send` is the raw ASGI send."""

    def __init__(
        self,
        send: Send,
        completion_id: str,
        model: str,
        headers: dict[str, str],
        include_loop_events: bool,
    ) -> None:
        self.send = send
        self.headers = headers
        self.include_loop_events = include_loop_events
        self.started = False
        self.role_sent = False
        self.last_write = time.monotonic()
        self._prefix = (
            b'{"id":'
            + orjson.dumps(completion_id)
            + b',"object":"chat.completion.chunk","created":'
            + str(int(time.time())).encode()
            + b',"model":'
            + orjson.dumps(model)
        )

    async def _write(self, data: bytes) -> None:
        try:
            if not self.started:
                self.started = True
                raw = [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                    *header_list(self.headers),
                ]
                await self.send({"type": "http.response.start", "status": 200, "headers": raw})
            await self.send({"type": "http.response.body", "body": data, "more_body": True})
        except OSError as exc:
            raise ClientDisconnected(str(exc)) from None
        self.last_write = time.monotonic()

    def _chunk(self, rest: dict[str, Any]) -> bytes:
        return b"data: " + self._prefix + b"," + orjson.dumps(rest)[1:] + b"\n\n"

    def _delta(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        if not self.role_sent:
            self.role_sent = True
            delta = {"role": "assistant", **delta}
        return {
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ]
        }

    async def content(self, text: str) -> None:
        await self._write(self._chunk(self._delta({"content": text})))

    async def progress(self, event: ev.RunEvent) -> None:
        """Renders the run's progress as `loop_event` chunks, when the client asked for them."""
        if not self.include_loop_events:
            return
        shown = loop_event(event)
        if shown is not None:
            await self._write(self._chunk({"choices": [], "loop_event": shown}))

    async def tool_calls(self, calls: list[dict[str, Any]]) -> None:
        indexed = [{"index": i, **call} for i, call in enumerate(calls)]
        await self._write(self._chunk(self._delta({"tool_calls": indexed})))

    async def finish(
        self, finish_reason: str | None, report: dict[str, Any], usage: dict[str, Any] | None
    ) -> None:
        last = self._delta({}, finish_reason)
        last["loop"] = report
        data = self._chunk(last)
        if usage is not None:
            data += self._chunk({"choices": [], "usage": usage})
        await self._write(data + DONE)
        await self.close()

    async def fail(self, error: dict[str, Any], report: dict[str, Any]) -> None:
        """A failure after the first byte: an event with `error` and no `choices`, as OpenAI
        sends it, so that every SDK raises it (SPEC §4.3)."""
        data = orjson.dumps({"error": error["error"], "loop": report})
        await self._write(b"data: " + data + b"\n\n" + DONE)
        await self.close()

    async def close(self) -> None:
        with contextlib.suppress(OSError):
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def keepalive(self, interval_s: float) -> None:
        """Sends an SSE comment whenever nothing was written for `interval_s`."""
        while True:
            wait = self.last_write + interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            try:
                await self._write(KEEPALIVE)
            except ClientDisconnected:
                return


def loop_event(event: ev.RunEvent) -> dict[str, Any] | None:
    """The `loop_event` object of a run event, for the events a stream shows (SPEC §4.3)."""
    if isinstance(event, ev.StepStarted):
        return {"type": "step_started", "step": event.step}
    if isinstance(event, ev.ToolStarted):
        return {"type": "tool_call", "step": event.step, "tool": event.call.name,
                "call_id": event.call.id}  # fmt: skip
    if isinstance(event, ev.ToolExecuted):
        return {"type": "tool_result", "step": event.step, "tool": event.call.name,
                "call_id": event.call.id, "outcome": event.result.outcome}  # fmt: skip
    if isinstance(event, ev.Nudged):
        return {"type": "nudge", "step": event.step}
    return None
