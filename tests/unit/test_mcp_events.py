"""The bounds on an MCP server's event stream over HTTP: each event, up to the blank line that
ends it, is counted before the chunk that ends it reaches the SDK."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx2
import pytest

from proxy.tools.mcp_transport import EventTooLarge, _BoundedEvents

SMALL = b'event: message\ndata: {"jsonrpc":"2.0","id":1,"result":{"a":[1,2]}}\n\n'
LARGE = b"data: [" + b"0," * 40 + b"0]\n\n"  # 41 numbers and the array: 42 values, 1 colon


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


async def seen(chunks: list[bytes], values: int = 40) -> tuple[list[str], str]:
    """The events the SDK's own parser reads from the stream, and the error that ended it."""
    stream = _BoundedEvents(Chunks(chunks), 1024, values)
    response = httpx2.Response(
        200,
        headers={"content-type": "text/event-stream"},
        stream=stream,
        request=httpx2.Request("POST", "http://mcp.test/mcp"),
    )
    events: list[str] = []
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
        assert error == "the server sent a message holding more than 40 JSON values " + (
            "(server.max_body_values)"
        )
    assert await seen([LARGE], values=43) == ([LARGE[6:-2].decode()], "")


async def test_an_event_longer_than_the_bound_stops_however_it_is_made() -> None:
    comments = b": keep-alive\n" * 100  # lines the SDK drops, no blank line among them
    out = await passed(cut(comments, 64), limit=1024)
    assert out[-1] == b"the server sent a message larger than 1024 bytes (max_message_bytes)"
    assert sum(map(len, out[:-1])) <= 1024
