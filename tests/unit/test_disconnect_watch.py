"""`run_or_cancel`: a run is cancelled when its client goes away, and a run that ends before
the watch starts costs no task."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.types import Message

from proxy.api.asgi import WATCH_AFTER_S, run_or_cancel


class Client:
    """An ASGI `receive` whose client leaves at `leaves_at` (loop time), or never."""

    def __init__(self, leaves_after_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        self.leaves_at = None if leaves_after_s is None else loop.time() + leaves_after_s
        self.asked = 0

    async def receive(self) -> Message:
        self.asked += 1
        if self.leaves_at is None:
            await asyncio.Event().wait()
        await asyncio.sleep(max(0.0, self.leaves_at - asyncio.get_running_loop().time()))
        return {"type": "http.disconnect"}


async def test_a_run_that_ends_before_the_watch_starts_makes_no_task() -> None:
    client = Client(None)
    before = len(asyncio.all_tasks())

    async def quick() -> str:
        assert len(asyncio.all_tasks()) == before
        return "done"

    assert await run_or_cancel(quick, client.receive) == "done"
    await asyncio.sleep(WATCH_AFTER_S * 2)  # the timer was cancelled: it never starts one
    assert client.asked == 0
    assert len(asyncio.all_tasks()) == before


async def test_a_client_that_leaves_early_stops_its_run_when_the_watch_starts() -> None:
    client = Client(0.0)  # gone before the run begins
    cancelled = asyncio.Event()

    async def long() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "done"

    started = time.monotonic()
    assert await run_or_cancel(long, client.receive) is None
    waited = time.monotonic() - started
    assert cancelled.is_set()
    assert WATCH_AFTER_S * 0.9 <= waited < WATCH_AFTER_S + 1.0


async def test_a_client_that_leaves_mid_run_stops_it_and_a_finished_run_is_left_alone() -> None:
    client = Client(WATCH_AFTER_S * 3)

    async def long() -> str:
        await asyncio.sleep(10)
        return "done"

    started = time.monotonic()
    assert await run_or_cancel(long, client.receive) is None
    assert time.monotonic() - started < 1.0

    staying = Client(None)

    async def medium() -> str:
        await asyncio.sleep(WATCH_AFTER_S * 2)  # watched, then done
        return "done"

    before = len(asyncio.all_tasks())
    assert await run_or_cancel(medium, staying.receive) == "done"
    assert staying.asked == 1  # the watch ran
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before  # and stopped with the run


async def test_a_cancellation_from_elsewhere_is_raised_as_it_is() -> None:
    client = Client(None)

    async def long() -> str:
        await asyncio.sleep(10)
        return "done"

    task = asyncio.create_task(run_or_cancel(long, client.receive))
    await asyncio.sleep(WATCH_AFTER_S * 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
