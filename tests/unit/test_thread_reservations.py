"""A thread's reservations (`proxy/state/expiring_threads.py`) when the run making one is
cancelled (its client gone) while the backend answers."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from proxy.state.expiring_threads import ExpiringThreads
from proxy.state.memory import MemoryStore


class SlowAnswers(MemoryStore):
    """The memory backend, whose reservations are made at once and answered a moment later,
    as a remote backend's are."""

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int], ttl_s: float | None = None
    ) -> tuple[bool, dict[str, int]]:
        made = await super().reserve(thread_id, limits, ttl_s)
        await asyncio.sleep(0.05)
        return made


async def test_a_reservation_its_run_left_while_it_was_made_is_given_back() -> None:
    threads = ExpiringThreads(SlowAnswers(), None)
    await threads.reserve("t", {"search": 5})
    leaving = asyncio.create_task(threads.reserve("t", {"search": 5}))
    await asyncio.sleep(0.01)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await asyncio.sleep(0.1)  # the reservation made, then given back
    assert await threads.thread_counts("t") == {"search": 1}
