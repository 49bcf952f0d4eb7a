"""`within`: `asyncio.wait_for` without a task of its own, on the path of every tool call."""

from __future__ import annotations

import asyncio

import pytest

from proxy.deadline import Deadline, within


async def test_the_result_comes_back_when_the_work_ends_in_time() -> None:
    async def work() -> str:
        await asyncio.sleep(0)
        return "done"

    assert await within(work(), 5) == "done"


async def test_work_that_takes_too_long_is_cancelled_and_times_out() -> None:
    cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        await within(work(), 0.01)
    assert cancelled.is_set()
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancellation_from_elsewhere_is_not_a_timeout() -> None:
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(within(work(), 60))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_error_of_the_work_is_raised_as_it_is() -> None:
    async def work() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await within(work(), 5)


async def test_time_held_does_not_count_toward_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    timer = Deadline(started + 0.05)
    timer.hold()
    await asyncio.sleep(0.1)  # past the deadline, held: not cancelled
    timer.release()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(1)
    assert timer.disarm()  # the cancellation was the deadline's
    assert loop.time() - started >= 0.15  # its 0.05 s, after the 0.1 s held


async def test_a_hold_longer_than_its_bound_makes_the_deadline_due() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    timer = Deadline(started + 0.02, max_hold=0.05)  # looked at once the deadline is due
    timer.hold()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(1)
    assert timer.disarm()
    assert timer.held_out
    assert 0.05 <= loop.time() - started < 1
