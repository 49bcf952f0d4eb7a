"""The streaming side of a run: `chat.completion.chunk` SSE written straight to ASGI `send`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.types import Send

from proxy.api.event_stream import EventStream
from proxy.engine import events as ev

DONE = b"data: [DONE]\n\n"


class SSEWriter(EventStream):
    """Implements the engine's `RunStream` as `chat.completion.chunk` events."""

    def __init__(
        self,
        send: Send,
        completion_id: str,
        model: str,
        headers: dict[str, str],
        include_loop_events: bool,
    ) -> None:
        super().__init__(send, headers)
        self.include_loop_events = include_loop_events
        self.role_sent = False
        self._opening = (
            b'{"id":'
            + orjson.dumps(completion_id)
            + b',"object":"chat.completion.chunk","created":'
            + str(int(time.time())).encode()
        )
        self._prefix = self._opening + b',"model":' + orjson.dumps(model)
        self._fixed = False  # a chunk was made: its prefix is every chunk's

    def heard(self, head: Mapping[str, str]) -> None:
        """Every chunk carries the upstream's `model`, `system_fingerprint` and `service_tier`
        as its first answer's chunks did, unless a chunk went out before it began."""
        if self._fixed or not head:
            return
        fields = orjson.dumps(head)
        if "model" in head:
            self._prefix = self._opening + b"," + fields[1:-1]
        else:
            self._prefix += b"," + fields[1:-1]

    def _chunk(self, rest: dict[str, Any]) -> bytes:
        self._fixed = True
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

    def opening(self) -> bytes:
        # The role, as OpenAI opens a stream, before the reply shows whether it holds text:
        # `null`, as OpenAI has it before tool calls (an empty string would be a text part).
        return self._chunk(self._delta({"content": None}))

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
        self,
        finish_reason: str | None,
        report: dict[str, Any],
        usage: dict[str, Any] | None,
        refusal: str | None = None,
    ) -> None:
        """The last chunk, with the reply's `refusal` before it when it has one (the SDKs'
        stream helpers put it on the message they make of the stream)."""
        data = self._chunk(self._delta({"refusal": refusal})) if refusal else b""
        last = self._delta({}, finish_reason)
        last["loop"] = report
        data += self._chunk(last)
        if usage is not None:
            data += self._chunk({"choices": [], "usage": usage})
        await self._write(data + DONE, last=True)

    async def fail(self, error: dict[str, Any], report: dict[str, Any]) -> None:
        """A failure after the first byte: an event with `error` and no `choices`, as OpenAI
        sends it, so that every SDK raises it (SPEC §4.3)."""
        data = orjson.dumps({"error": error["error"], "loop": report})
        await self._write(b"data: " + data + b"\n\n" + DONE, last=True)


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
