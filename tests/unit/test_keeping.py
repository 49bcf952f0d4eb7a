"""A run's keep, awaited to its end through its run's cancellations, but for the time its caller
gives once the server's drain ended."""

from __future__ import annotations

import asyncio

import pytest

from proxy.engine.keeping import ended_well, to_its_end


class Drain:
    """The grace a server gives: none until its drain ends."""

    def __init__(self) -> None:
        self.ended = False

    def grace_s(self) -> float | None:
        return 0.2 if self.ended else None


async def keeping(save_s: float, drain: Drain) -> tuple[asyncio.Task[None], asyncio.Future[None]]:
    """A run's task awaiting a keep of `save_s`; both, once the keep has begun."""
    keep = asyncio.ensure_future(asyncio.sleep(save_s))
    run = asyncio.create_task(to_its_end(keep, drain.grace_s))
    await asyncio.sleep(0.01)
    return run, keep


async def test_a_keep_is_finished_when_its_client_leaves_during_the_drain() -> None:
    """The drain had begun, not ended: its 3 s were given to a client's leaving too, and a
    slow save was cut."""
    drain = Drain()
    run, keep = await keeping(0.5, drain)
    run.cancel()  # the client left
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 5)
    assert ended_well(keep)


async def test_a_keep_is_cut_at_the_drain_s_end_after_its_client_left() -> None:
    """Its client had left before the drain ended: the grace was asked once, at the first
    cancellation, and the drain's end then gave none (held past the server's exit)."""
    drain = Drain()
    run, keep = await keeping(30, drain)
    loop = asyncio.get_running_loop()
    run.cancel()  # the client left
    await asyncio.sleep(0.05)
    drain.ended = True
    cut_at = loop.time()
    run.cancel()  # the drain's end
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, 5)
    assert loop.time() - cut_at < 1.0
    assert keep.cancelled()
