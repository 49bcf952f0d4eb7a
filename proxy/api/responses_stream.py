"""The streaming side of `/v1/responses`: the Responses event stream (SPEC §12.3) written straight
to ASGI `send`, every event with a rising `sequence_number`."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from starlette.types import Send

from proxy.api.event_stream import EventStream
from proxy.api.response_items import ServerCalls, message_item, refusal_item
from proxy.engine import events as ev
from proxy.engine.values import PART_BREAK

DELTA = b"response.output_text.delta"
TEXT = f"\x00text {uuid.uuid4()}\x00"  # stands for a message's text in an event being made
TEXT_JSON = orjson.dumps(TEXT)


class ResponsesStream(EventStream):
    """Implements the engine's `RunStream`. Nothing is sent before the run has something to
    show (text, a server call, its end), so a run that fails before then still gets a plain
    HTTP error; the first event is always `response.created`. The run's text is a `message`
    item, and each server call that runs an `mcp_call` item (when `calls` records them); one
    item is open at a time, as OpenAI streams them (Codex drops a text delta that comes while
    another item is open), so a server call closes the message before it and the text after
    it is a message of its own. The blank line that parts two steps' texts (SPEC §4.3) ends
    the message before the call, so the message after it begins with its step's text (the
    Agents SDK answers with the last message's) and a client reading every message's text
    still reads the final text."""

    def __init__(
        self,
        send: Send,
        base: dict[str, Any],
        headers: dict[str, str],
        calls: ServerCalls | None,
        prefix: str,
    ) -> None:
        super().__init__(send, headers)
        self.base = base  # the response as `response.created` shows it
        self.calls = calls
        self.opened = False  # `response.created` was sent
        self.output: list[dict[str, Any]] = []  # items by output_index
        self._sequence = 0
        self._prefix = prefix
        self._messages = 0  # message items opened
        self._message_id = f"msg_{prefix}"
        self._message_index: int | None = None  # of the message open, if one is
        self._text: list[str] = []  # of the message open
        self._streamed = False  # text went out
        self._parted = False  # the message closed last ended with the break the next text has
        self._indexes: dict[str, int] = {}  # item id -> output_index
        self._delta_head = b""
        # Server calls run side by side (`parallel_tool_calls`) are shown one after another:
        # the call shown and not yet done, those started after it, and those of them done.
        self._shown: str | None = None
        self._waiting: list[dict[str, Any]] = []
        self._done: dict[str, dict[str, Any]] = {}

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        number = self._sequence
        self._sequence += 1
        head = {"type": kind, "sequence_number": number}
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({**head, **fields}) + b"\n\n"

    def opening(self) -> bytes:
        return self._opening()

    def _opening(self) -> bytes:
        """`response.created` and `response.in_progress`, once, before any other event."""
        if self.opened:
            return b""
        self.opened = True
        response = b',"response":' + orjson.dumps(self.base) + b"}\n\n"
        data = b""
        for kind in (b"response.created", b"response.in_progress"):
            number = str(self._sequence).encode()
            self._sequence += 1
            data += (
                b"event: " + kind + b'\ndata: {"type":"' + kind
                + b'","sequence_number":' + number + response
            )  # fmt: skip
        return data

    def _add(self, item: dict[str, Any]) -> tuple[int, bytes]:
        index = len(self.output)
        self.output.append(item)
        self._indexes[item["id"]] = index
        added = {"output_index": index, "item": item}
        return index, self._event("response.output_item.added", added)

    # -- the run's text -----------------------------------------------------------------------

    async def content(self, text: str) -> None:
        data = self._opening()
        if self._message_index is None:  # a call still open was cut short: text comes after
            data += self._end_unfinished() + self._open_message()  # the calls of a step only
            if self._parted and text.startswith(PART_BREAK):
                text = text[len(PART_BREAK) :]
        self._text.append(text)
        self._streamed = True
        await self._write(data + self._delta(text))

    def _delta(self, text: str) -> bytes:
        """An `output_text.delta` of the message open."""
        number = str(self._sequence).encode()
        self._sequence += 1
        return (
            self._delta_head + number + b',"delta":' + orjson.dumps(text) + b',"logprobs":[]}\n\n'
        )

    def _open_message(self) -> bytes:
        self._messages += 1
        self._message_id = f"msg_{self._prefix}" + (
            f"_{self._messages}" if self._messages > 1 else ""
        )
        item = message_item(self._message_id, "", "in_progress")
        item["content"] = []
        index, data = self._add(item)
        self._message_index = index
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {"item_id": self._message_id, "output_index": index, "content_index": 0}
        data += self._event("response.content_part.added", {**where, "part": part})
        self._delta_head = (
            b"event: " + DELTA + b'\ndata: {"type":"' + DELTA + b'","item_id":'
            + orjson.dumps(self._message_id)
            + b',"output_index":' + str(index).encode()
            + b',"content_index":0,"sequence_number":'
        )  # fmt: skip
        return data

    def _refusal_message(self, refusal: str) -> bytes:
        """A message holding the model's refusal, added and done, as OpenAI streams one."""
        item_id = f"msg_{self._prefix}" + ("_refusal" if self.output else "")
        item = refusal_item(item_id, refusal)
        index, data = self._add({**item, "status": "in_progress", "content": []})
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        (part,) = item["content"]
        data += (
            self._event("response.content_part.added", {**where, "part": {**part, "refusal": ""}})
            + self._event("response.refusal.delta", {**where, "delta": refusal})
            + self._event("response.refusal.done", {**where, "refusal": refusal})
            + self._event("response.content_part.done", {**where, "part": part})
        )
        self.output[index] = item
        done = {"output_index": index, "item": item}
        return data + self._event("response.output_item.done", done)

    def _close_message(self, status: str = "completed", parted: bool = False) -> list[bytes]:
        """The message open ended: `completed`, or `incomplete` when its text was cut short;
        `parted` by a server call, its text ends with the break the next step's would begin
        with."""
        index = self._message_index
        if index is None:
            return []
        where = {"item_id": self._message_id, "output_index": index, "content_index": 0}
        self._parted = parted
        data = self._delta(PART_BREAK) if parted else b""
        if parted:
            self._text.append(PART_BREAK)
        text = "".join(self._text)
        self.output[index] = message_item(self._message_id, text, status)
        self._message_index, self._text = None, []
        # Three events carry the whole text: it is encoded once, and sent between their heads
        # and tails, each copied no more (a long text's events would hold the loop a while).
        encoded = orjson.dumps(text)
        part = {"type": "output_text", "text": TEXT, "annotations": [], "logprobs": []}
        item = message_item(self._message_id, TEXT, status)
        done = {"output_index": index, "item": item}
        return [
            data,
            *self._around(
                encoded, "response.output_text.done", {**where, "text": TEXT, "logprobs": []}
            ),
            *self._around(encoded, "response.content_part.done", {**where, "part": part}),
            *self._around(encoded, "response.output_item.done", done),
        ]

    def _around(self, encoded: bytes, kind: str, fields: dict[str, Any]) -> tuple[bytes, ...]:
        """The event of `fields`, the text in them (`TEXT`) given `encoded`: its parts."""
        head, tail = self._event(kind, fields).split(TEXT_JSON)
        return head, encoded, tail

    # -- server calls -------------------------------------------------------------------------

    async def progress(self, event: ev.RunEvent) -> None:
        calls = self.calls
        if calls is None:
            return
        if isinstance(event, ev.ToolStarted):
            item = calls.started(event)
            parts = [self._opening(), *self._close_message(parted=True)]
            if self._shown is not None:  # another call runs beside it: shown after it
                self._waiting.append(item)
                return
            await self._write(*parts, self._show(item))
        elif isinstance(event, ev.ToolExecuted):
            done = calls.executed(event)
            if done is None:
                return
            if done["id"] != self._shown:  # waiting to be shown
                self._done[done["id"]] = done
                return
            await self._write(self._finish_call(done) + self._show_waiting())

    def _show(self, item: dict[str, Any]) -> bytes:
        """A server call's item added, in progress (as it began: one that waited to be shown
        may have ended meanwhile)."""
        index, added = self._add({**item, "status": "in_progress", "output": None, "error": None})
        self._shown = item["id"]
        where = {"output_index": index, "item_id": item["id"]}
        return added + self._event("response.mcp_call.in_progress", where)

    def _finish_call(self, done: dict[str, Any]) -> bytes:
        index = self._indexes[done["id"]]
        self.output[index] = done
        self._shown = None
        where = {"output_index": index, "item_id": done["id"]}
        kind = "response.mcp_call.failed" if done["error"] else "response.mcp_call.completed"
        return self._event(kind, where) + self._event(
            "response.output_item.done", {"output_index": index, "item": done}
        )

    def _show_waiting(self) -> bytes:
        """The calls that waited to be shown, each done as soon as it is shown if it was, up
        to one still running (left shown)."""
        data = b""
        while self._waiting and self._shown is None:
            item = self._waiting.pop(0)
            data += self._show(item)
            done = self._done.pop(item["id"], None)
            if done is not None:
                data += self._finish_call(done)
        return data

    # -- the end ------------------------------------------------------------------------------

    def closing(
        self,
        text: str | None,
        client_items: list[dict[str, Any]],
        cut: bool = False,
        refusal: str | None = None,
    ) -> list[bytes]:
        """The events that end the output: the message closed (with `text` sent first when
        none was streamed; `incomplete` when `cut` short), a message with the model's
        `refusal`, and the client calls. `output` is then whole."""
        parts = [self._opening(), self._end_unfinished()]
        if not self._streamed and text:
            parts.append(self._open_message())
            self._text.append(text)
            parts.append(self._delta(text))
        parts += self._close_message("incomplete" if cut else "completed")
        if refusal:
            parts.append(self._refusal_message(refusal))
        parts.extend(self._client_call(item) for item in client_items)
        return parts

    def _end_unfinished(self) -> bytes:
        """The server calls that started and never finished (the run stopped), ended, one
        after another: the one shown, then those waiting to be shown (done or not)."""
        if self.calls is None:
            return b""
        ended = {item["id"]: item for item in self.calls.unfinished()}
        data = b""
        while self._shown is not None or self._waiting:
            if self._shown is None:
                data += self._show_waiting()
                continue
            data += self._finish_call(ended.pop(self._shown))  # shown, never finished: failed
        return data

    async def finish(self, closing: list[bytes], response: dict[str, Any]) -> None:
        """Sends `closing` and `response.completed` (or `.incomplete`) with `response`."""
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        await self._write(*closing, self._event(kind, {"response": response}), last=True)

    def _client_call(self, item: dict[str, Any]) -> bytes:
        custom = item["type"] == "custom_tool_call"
        field, family = (
            ("input", "custom_tool_call_input")
            if custom
            else ("arguments", "function_call_arguments")
        )
        value = item[field]
        index, data = self._add({**item, "status": "in_progress", field: ""})
        self.output[index] = item
        where = {"item_id": item["id"], "output_index": index}
        done = {**where, field: value}
        if not custom:
            done["name"] = item["name"]
        return (
            data
            + self._event(f"response.{family}.delta", {**where, "delta": value})
            + self._event(f"response.{family}.done", done)
            + self._event("response.output_item.done", {"output_index": index, "item": item})
        )

    async def fail(self, response: dict[str, Any], closing: list[bytes] | None = None) -> None:
        """A failure after the first byte: the items open ended (the text so far, calls cut
        short; or as `closing`, made and not sent, ended them), then `response.failed` with
        the error, the `loop` report and every item at the index it was streamed at, in
        `response` (SPEC §12.3)."""
        parts = closing or [
            self._opening(),
            *self._close_message("incomplete"),
            self._end_unfinished(),
        ]
        response["output"] = self.output
        await self._write(*parts, self._event("response.failed", {"response": response}), last=True)
