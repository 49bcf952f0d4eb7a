"""A long text's closing events: whole in each event that carries it, its text encoded once, and
sent in slices of at most `WRITE_SLICE`, the loop given to others between them (SPEC §12.3: the
done events and the final response each carry the whole text)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
from typing import Any

import pytest
from starlette.types import Message

from proxy.api.event_stream import WRITE_SLICE
from proxy.api.responses_stream import TEXT, ResponsesStream
from proxy.errors import ClientDisconnected
from tests.response_events import checked, parse_events, stream_text

BASE = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "m", "output": []}
PIECE = "é" * 499 + "\n"  # escaped and multi-byte: the encoded text is no copy of the str
PIECES = 6_000  # ~6 MiB of UTF-8


class Client:
    """An ASGI `send` that keeps each body message, and counts the turns a task beside the
    stream gets while its bodies are sent."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.turns_between: list[int] = []
        self.turns = 0

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.body":
            self.bodies.append(message["body"])
            self.turns_between.append(self.turns)

    async def beside(self) -> None:
        while True:
            self.turns += 1
            await asyncio.sleep(0)

    def events(self) -> list[dict[str, Any]]:
        return parse_events(b"".join(self.bodies).decode())


async def streamed(end: str) -> Client:
    client = Client()
    ticker = asyncio.create_task(client.beside())
    await asyncio.sleep(0)  # it runs
    stream = ResponsesStream(client.send, dict(BASE), {}, None, "p")
    for _ in range(PIECES):
        await stream.content(PIECE)
    text = PIECE * PIECES
    if end == "finish":
        closing = stream.closing(None, [])
        output = [{**item} for item in stream.output]
        await stream.finish(closing, {**BASE, "status": "completed", "output": output})
    else:
        await stream.fail({**BASE, "status": "failed", "error": {"code": "x", "message": "y"}})
    ticker.cancel()
    events = client.events()
    assert stream_text(events) == text
    return client


@pytest.mark.parametrize("end", ["finish", "fail"])
async def test_a_long_text_is_whole_in_every_event_that_carries_it(end: str) -> None:
    client = await streamed(end)
    events = client.events()
    final = checked(events)
    text = PIECE * PIECES
    done = {e["type"]: e for e in events}
    assert done["response.output_text.done"]["text"] == text
    assert done["response.content_part.done"]["part"]["text"] == text
    assert done["response.output_item.done"]["item"]["content"][0]["text"] == text
    assert final["output"][0]["content"][0]["text"] == text
    status = "completed" if end == "finish" else "incomplete"
    assert done["response.output_item.done"]["item"]["status"] == status
    assert TEXT.encode() not in b"".join(client.bodies)  # what stood for it, nowhere
    assert json.dumps(TEXT)[1:-1].encode() not in b"".join(client.bodies)


@pytest.mark.parametrize("end", ["finish", "fail"])
async def test_a_long_text_s_events_go_in_slices_with_turns_for_others_between(end: str) -> None:
    client = await streamed(end)
    assert max(len(body) for body in client.bodies) <= WRITE_SLICE + 64 * 1024
    ends = [i for i, body in enumerate(client.bodies) if b"output_text.done" in body]
    last = client.bodies[ends[0] :]
    assert sum(len(body) for body in last) > 3 * len((PIECE * PIECES).encode())
    turns = client.turns_between[ends[0] :]
    assert all(later > earlier for earlier, later in itertools.pairwise(turns))


class HeldClient:
    """An ASGI `send` that holds its second body message until let go (a slow reader)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.holding = asyncio.Event()
        self.let_go = asyncio.Event()

    async def send(self, message: Message) -> None:
        if message["type"] != "http.response.body":
            return
        if len(self.bodies) == 1:
            self.holding.set()
            await self.let_go.wait()
        self.bodies.append(message["body"])


LONG_EVENT = b"data: " + b'{"text": "' + b"x" * (2 * WRITE_SLICE) + b'"}\n\n'


async def test_a_write_beside_a_write_in_slices_goes_after_it_whole() -> None:
    """A keep-alive comment (or a server call's event, from a call's task) written while a long
    write waited for its reader landed in the middle of its event."""
    client = HeldClient()
    stream = ResponsesStream(client.send, dict(BASE), {}, None, "p")
    long = asyncio.create_task(stream._write(b"data: {}\n\n", LONG_EVENT))
    await client.holding.wait()
    beside = asyncio.create_task(stream.comment())
    other = asyncio.create_task(stream._write(b'data: {"other": 1}\n\n'))
    await asyncio.sleep(0.01)
    client.let_go.set()
    await asyncio.gather(long, beside, other)
    sent = b"".join(client.bodies)
    assert sent.startswith(b"data: {}\n\n" + LONG_EVENT)
    assert sorted(sent[len(b"data: {}\n\n" + LONG_EVENT) :].split(b"\n\n")) == [
        b"",
        b": keep-alive",
        b'data: {"other": 1}',
    ]


@pytest.mark.parametrize("reads", [True, False])
async def test_a_write_cancelled_between_its_slices_ends_its_events_or_the_stream(
    reads: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Cancelled (a time budget, the drain's end) while its reader was slow, a long write left
    half an event, and the stream's end was written on after it, as the rest of that event.
    It goes on for `finish_s`, so that the stream can still say how the run ended; a reader that
    does not take the rest meanwhile has it cut, and the stream says no more."""
    client = HeldClient()
    stream = ResponsesStream(client.send, dict(BASE), {}, None, "p")
    stream.finish_s = 5.0 if reads else 0.05
    long = asyncio.create_task(stream._write(LONG_EVENT))
    await client.holding.wait()
    long.cancel()
    if reads:
        client.let_go.set()
    with pytest.raises(asyncio.CancelledError):
        await long
    client.let_go.set()
    if reads:
        await stream._write(b"data: {}\n\n", last=True)
        assert b"".join(client.bodies) == LONG_EVENT + b"data: {}\n\n"
        return
    await stream._write(b"data: {}\n\n", last=True)  # nothing more is sent: the run ends
    await stream.comment()  # as it would (its stop as it was), a keep-alive says nothing
    assert b"".join(client.bodies) == LONG_EVENT[:WRITE_SLICE]
    assert "a stream was cut in the middle of an event" in caplog.text  # (the server's own
    # "returned without completing response" not said again: CUT_ON_PURPOSE)


async def test_a_client_gone_while_a_cancelled_write_ends_its_events_is_no_unread_error() -> None:
    """The sending task's error, once the request's task was cancelled, was left unread: the
    event loop logged "Task exception was never retrieved" for every such stream."""
    client = HeldClient()
    told: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: told.append(context))

    async def gone(message: Message) -> None:
        await client.send(message)
        if len(client.bodies) > 1:
            raise OSError("the client went away")

    stream = ResponsesStream(gone, dict(BASE), {}, None, "p")
    long = asyncio.create_task(stream._write(LONG_EVENT))
    await client.holding.wait()
    long.cancel()
    client.let_go.set()
    with pytest.raises(asyncio.CancelledError):
        await long
    del long
    gc.collect()
    await asyncio.sleep(0)
    assert told == []


async def test_a_client_gone_in_the_middle_of_an_event_ends_the_run_as_cancelled() -> None:
    """Its send fails between two slices: the run is told (ClientDisconnected), and so is any
    later write, whatever would follow being read as the rest of that event."""
    client = HeldClient()

    async def gone(message: Message) -> None:
        await client.send(message)
        if len(client.bodies) > 1:
            raise OSError("the client went away")

    stream = ResponsesStream(gone, dict(BASE), {}, None, "p")
    client.let_go.set()
    with pytest.raises(ClientDisconnected):
        await stream._write(LONG_EVENT)
    with pytest.raises(ClientDisconnected):
        await stream._write(b"data: {}\n\n", last=True)
