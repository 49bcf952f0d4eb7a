"""Sync callables run off the event loop in threads that are kept for the next call, at most
`limit` at once; a call waits for a thread unless every one is stuck."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable

import pytest

from proxy.callables import KEEP_IDLE, CallRaised, CallThreads, NoWorkerFree, call


async def test_sequential_calls_reuse_one_thread() -> None:
    threads = CallThreads(4)
    idents = {await threads.run(threading.get_ident) for _ in range(20)}
    assert len(idents) == 1
    assert threading.get_ident() not in idents  # never the event loop's thread
    assert threads.busy == 0


async def test_concurrent_calls_each_get_a_thread_and_some_are_kept() -> None:
    limit = KEEP_IDLE + 4
    threads = CallThreads(limit)
    barrier = threading.Barrier(limit, timeout=10)

    def meet() -> int:
        barrier.wait()  # returns only once every call runs at the same time
        return threading.get_ident()

    first = await asyncio.gather(*(threads.run(meet) for _ in range(limit)))
    assert len(set(first)) == limit
    assert threads.idle == KEEP_IDLE  # the others ended
    kept = await asyncio.gather(*(threads.run(threading.get_ident) for _ in range(KEEP_IDLE)))
    assert set(kept) <= set(first)


async def test_a_call_past_the_limit_waits_for_an_awaited_call_and_errors_come_back() -> None:
    threads = CallThreads(1)
    release = threading.Event()
    first = asyncio.ensure_future(threads.run(release.wait, 10))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(threads.run(threading.get_ident))
    await asyncio.sleep(0.05)
    assert not second.done()  # it waits: the call before it is awaited, not stuck
    release.set()
    assert await first is True
    assert isinstance(await second, int)

    def broken() -> None:
        raise ValueError("tool bug")

    with pytest.raises(ValueError, match="tool bug"):
        await threads.run(broken)
    assert threads.busy == 0


async def test_when_every_thread_holds_a_call_given_up_on_the_next_fails_at_once() -> None:
    threads = CallThreads(1)
    release = threading.Event()
    stuck = asyncio.ensure_future(threads.run(release.wait, 10))
    waiting = asyncio.ensure_future(threads.run(threading.get_ident))
    await asyncio.sleep(0.05)
    stuck.cancel()  # its caller gives up (a timeout): the thread is still held
    with pytest.raises(NoWorkerFree):
        await waiting  # woken by that, it does not wait out a stuck call
    with pytest.raises(NoWorkerFree):
        await threads.run(threading.get_ident)
    release.set()
    for _ in range(100):
        await asyncio.sleep(0.01)
        if threads.busy == 0:
            break
    assert isinstance(await threads.run(threading.get_ident), int)  # the thread came back


def _exits() -> None:
    sys.exit(2)


def _stops() -> None:
    next(iter(()))  # what `next()` of an exhausted iterator raises


async def _cancels_itself() -> None:
    raise asyncio.CancelledError


@pytest.mark.parametrize(("func", "named"), [(_exits, "SystemExit: 2"), (_stops, "StopIteration")])
async def test_what_a_sync_call_raises_past_exceptions_is_a_failure_that_names_it(
    func: Callable[[], None], named: str
) -> None:
    """`SystemExit` would end the process, `StopIteration` cannot be put in a future (the
    caller would wait for ever): each comes back as CallRaised."""
    with pytest.raises(CallRaised, match=rf"^{named}$"):
        await asyncio.wait_for(CallThreads(1).run(func), 5)


async def test_an_async_call_s_own_cancellation_or_exit_is_a_failure_its_caller_s_is_not() -> None:
    with pytest.raises(CallRaised, match=r"^CancelledError$"):
        await call(_cancels_itself, CallThreads(1))

    async def exits() -> None:
        raise SystemExit(3)

    with pytest.raises(CallRaised, match=r"^SystemExit: 3$"):
        await call(exits, CallThreads(1))
    waiting = asyncio.ensure_future(call(asyncio.sleep, CallThreads(1), 10))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_callers_waiting_for_a_thread_get_one_in_turn() -> None:
    threads = CallThreads(1)
    release = threading.Event()
    first = asyncio.ensure_future(threads.run(release.wait, 10))
    order: list[str] = []

    def record(name: str) -> None:
        order.append(name)

    waiting = []
    for name in "abc":
        waiting.append(asyncio.ensure_future(threads.run(record, name)))
        await asyncio.sleep(0.01)
    release.set()
    await asyncio.gather(first, *waiting)
    assert order == ["a", "b", "c"]


def test_a_call_given_up_on_that_outlives_its_event_loop_leaves_no_count_behind() -> None:
    """Its thread's return is counted in the thread: the next loop finds the thread free."""
    threads = CallThreads(1)
    release = threading.Event()

    async def give_up() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(threads.run(release.wait, 10), 0.05)

    asyncio.run(give_up())
    release.set()
    for _ in range(100):
        if threads.busy == 0:
            break
        time.sleep(0.01)

    async def again() -> int:
        return await asyncio.wait_for(threads.run(threading.get_ident), 5)

    assert isinstance(asyncio.run(again()), int)
