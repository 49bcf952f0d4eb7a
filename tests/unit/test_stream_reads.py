"""An upstream's stream read into a reply without holding the event loop, however its reads
fall: a long read is decoded in slices, other tasks served between them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import orjson
import pytest

from proxy.errors import UpstreamBadReply
from proxy.upstream.reply import ReplyLimits
from proxy.upstream.sse import EventTooLarge, SSEDecoder
from proxy.upstream.stream import READ_SLICE, ReplyReader


def event(delta: dict[str, object], finish: str | None = None) -> bytes:
    chunk = {
        "id": "c",
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def one_read(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def test_a_read_of_a_megabyte_of_empty_events_lets_other_tasks_run() -> None:
    """Comments and blank lines (30 MB of them held the loop 0.3 s a read, again and again)."""
    empty = b":\n\n" * (1024 * 1024 // 3) + b"\n" * 100_000
    data = event({"content": "Hi"}) + empty + event({}, "stop") + b"data: [DONE]\n\n"
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    reader = ReplyReader("up", ReplyLimits(), [])
    reply = await reader.stream(one_read(data), None, time.monotonic())
    ticker.cancel()
    assert reply.message["content"] == "Hi"
    assert reply.finish_reason == "stop"
    assert ticks >= len(data) // READ_SLICE - 1  # served between the slices of the read


async def test_a_streamed_finish_reason_longer_than_a_word_is_no_reply() -> None:
    data = event({"content": "Hi"}) + event({}, "x" * 100_000) + b"data: [DONE]\n\n"
    reader = ReplyReader("up", ReplyLimits(), [])
    with pytest.raises(UpstreamBadReply, match="finish_reason is not a string of at most 64"):
        await reader.stream(one_read(data), None, time.monotonic())


def test_an_event_of_many_data_lines_is_held_with_its_line_breaks() -> None:
    """`held` bounds what a read may end (a stream's large events are parsed in their turn) and
    `max_event_bytes` is checked against it: empty `data:` lines counted nothing, so an event
    of 200,010 bytes was held as 6, and 600 KB of them passed a bound of 1,000."""
    decoder = SSEDecoder(max_event_bytes=1 << 20)
    decoder.feed(b'data: {"a":[\n')
    for _ in range(20):
        decoder.feed(b"data:\n" * 10_000)
    held = decoder.held
    [event] = decoder.feed(b"data: 0]}\n\n")
    assert held + len(b"data: 0]}\n\n") >= len(event)
    bounded = SSEDecoder(max_event_bytes=1000)
    bounded.feed(b"data:\n" * 10_000)
    assert isinstance(bounded.failure, EventTooLarge)
