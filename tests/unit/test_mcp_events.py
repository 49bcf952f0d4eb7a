"""The bounds on an MCP server's event stream over HTTP: each event, read as the SDK reads it,
is counted before the chunk that completes it (or the stream's end) reaches the SDK."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import anyio
import httpx2
import pytest

from proxy.tools import mcp_exchanges
from proxy.tools.mcp_bounds import BoundedBodies, EventTooLarge, _BoundedEvents

SMALL = b'event: message\ndata: {"jsonrpc":"2.0","id":1,"result":{"a":[1,2]}}\n\n'
LARGE = b"data: [" + b"0," * 40 + b"0]\n\n"  # 41 numbers and the array: 42 values, 1 colon
TOO_MANY = "the server sent a message holding more than 40 JSON values (server.max_body_values)"


class Chunks(httpx2.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


def cut(text: bytes, size: int) -> list[bytes]:
    return [text[i : i + size] for i in range(0, len(text), size)]


async def passed(chunks: list[bytes], limit: int = 1024, values: int = 40) -> list[bytes]:
    """The chunks let through, and EventTooLarge as `.args` of the last when one is raised."""
    out: list[bytes] = []
    try:
        async for chunk in _BoundedEvents(Chunks(chunks), limit, values):
            out.append(chunk)
    except EventTooLarge as exc:
        out.append(str(exc).encode())
    return out


async def seen(
    chunks: list[bytes], values: int = 40, content_type: str = "text/event-stream"
) -> tuple[list[str], str]:
    """The events the SDK's own parser reads from an answer of `chunks` through the proxy's
    bounded transport, and the error that ended it."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": content_type}, stream=Chunks(chunks))

    client = httpx2.AsyncClient(transport=BoundedBodies(httpx2.MockTransport(answer), 1024, values))
    events: list[str] = []
    async with client, client.stream("POST", "http://mcp.test/mcp") as response:
        try:
            async for event in httpx2.EventSource(response):
                events.append(event.data)
        except EventTooLarge as exc:
            return events, str(exc)
    return events, ""


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
async def test_events_under_the_bounds_pass_unchanged_however_they_are_cut(newline: bytes) -> None:
    stream = (SMALL * 3).replace(b"\n", newline)
    for size in (1, 2, 3, 7, len(stream)):
        assert b"".join(await passed(cut(stream, size))) == stream


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
async def test_an_event_over_the_values_bound_ends_the_stream_before_the_sdk_reads_it(
    newline: bytes,
) -> None:
    stream = (SMALL + LARGE + SMALL).replace(b"\n", newline)
    first = SMALL.split(b"data: ")[1].strip().decode()
    for size in (1, 2, 5, 64, len(stream)):
        events, error = await seen(cut(stream, size))
        assert events in ([], [first])  # the first, if its end came in a chunk of its own
        assert error == TOO_MANY
    assert await seen([LARGE], values=43) == ([LARGE[6:-2].decode()], "")


async def test_lines_the_sdk_drops_pass_and_a_line_longer_than_the_bound_stops() -> None:
    comments = b": keep-alive\n" * 100  # no blank line among them: they grow nothing
    assert b"".join(await passed(cut(comments, 64), limit=1024)) == comments
    endless = b"data: " + b"x" * 2000  # one line that never ends
    out = await passed(cut(endless, 64), limit=1024)
    assert out[-1] == b"the server sent a message larger than 1024 bytes (max_message_bytes)"
    assert sum(map(len, out[:-1])) <= 1024


@pytest.mark.parametrize("line", [b': "', b'id: "', b'x-note: "'])
async def test_the_values_are_counted_in_the_data_the_sdk_parses_whatever_lines_surround_it(
    line: bytes,
) -> None:
    # A quote on a line the SDK drops (a comment, a field it ignores) must not make the count
    # read the data as one string.
    event = line + b"\n" + LARGE[:-1] + line + b"\n\n"
    assert await seen([event]) == ([], TOO_MANY)


@pytest.mark.parametrize("end", [b"\r", b"\n\r"])
async def test_an_event_the_stream_s_end_completes_is_counted_too(end: bytes) -> None:
    # The SDK's parser takes a CR held back at the end of the stream as a line end, and
    # dispatches the event it completes.
    stream = LARGE[:-2] + end
    assert await seen([stream]) == ([], TOO_MANY)
    assert await seen([stream], values=43) == ([LARGE[6:-2].decode()], "")


async def test_an_answer_in_another_charset_is_read_in_it() -> None:
    utf16 = "text/event-stream; charset=utf-16-le"
    small = SMALL.decode().encode("utf-16-le")
    first = SMALL.split(b"data: ")[1].strip().decode()
    assert await seen(cut(small * 40, 7), content_type=utf16) == ([first] * 40, "")
    large = (SMALL + LARGE).decode().encode("utf-16-le")
    assert await seen(cut(large, 7), content_type=utf16) == ([first], TOO_MANY)


async def test_an_event_stream_is_known_however_its_type_is_spelled() -> None:
    assert await seen([SMALL, LARGE], content_type="Text/Event-Stream") == (
        [SMALL.split(b"data: ")[1].strip().decode()],
        TOO_MANY,
    )


async def test_event_streams_asked_for_at_once_are_opened_a_turn_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each GET read the last one's time before its wait and wrote it after: GETs sent at
    once all went at once after one wait."""
    monkeypatch.setattr(mcp_exchanges, "GET_EVERY_S", 0.2)
    opened: list[float] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        opened.append(anyio.current_time())
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=b"")

    timed = mcp_exchanges.TimedExchanges(httpx2.MockTransport(answer), 5, 5)
    async with httpx2.AsyncClient(transport=timed) as client, anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(client.get, "http://mcp.test/mcp")
    gaps = [later - earlier for earlier, later in itertools.pairwise(sorted(opened))]
    assert len(opened) == 4
    assert min(gaps) >= 0.19, gaps
