"""Sync callables run off the event loop in threads that are kept for the next call, at most
`limit` at once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from proxy.callables import KEEP_IDLE, CallThreads, NoWorkerFree


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


async def test_a_call_past_the_limit_fails_at_once_and_errors_come_back() -> None:
    threads = CallThreads(1)
    release = threading.Event()
    stuck = asyncio.ensure_future(threads.run(release.wait, 10))
    await asyncio.sleep(0.05)
    with pytest.raises(NoWorkerFree):
        await threads.run(threading.get_ident)
    release.set()
    assert await stuck is True

    def broken() -> None:
        raise ValueError("tool bug")

    with pytest.raises(ValueError, match="tool bug"):
        await threads.run(broken)
    assert threads.busy == 0
