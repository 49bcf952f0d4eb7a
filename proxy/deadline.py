"""A deadline on the current task: what `asyncio.timeout` does, for a third of its cost (one
timer, no context manager), on paths every request takes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


# A hold shorter than this does not move the deadline (not worth a new timer).
HELD_COUNTED_S = 0.001


class Deadline:
    """Cancels the current task at `when` (event loop time) unless `disarm`ed first. The
    caller catches the CancelledError and asks `disarm` whether it was this deadline's.

    Time between `hold` and `release` does not count toward it; `max_hold` bounds one hold
    that lasts past the deadline (it is looked at then: a hold is let last until the later of
    the deadline and `max_hold` after its start), and `held_out` says the deadline came so."""

    __slots__ = (
        "_cancelling",
        "_expired",
        "_held_at",
        "_loop",
        "_max_hold",
        "_task",
        "_timer",
        "_when",
        "held_out",
    )

    def __init__(self, when: float, max_hold: float | None = None) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Deadline needs a running task")
        self._task = task
        self._cancelling = task.cancelling()  # cancellations already asked for, not ours
        self._expired = False
        self._when = when
        self._held_at: float | None = None
        self._max_hold = max_hold
        self.held_out = False
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = self._loop.call_at(when, self._fire)

    @property
    def expired(self) -> bool:
        """The deadline came (and cancelled the task), a hold held too long included."""
        return self._expired

    def hold(self) -> None:
        """From now until `release`, time does not count toward the deadline."""
        self._held_at = self._loop.time()

    def release(self) -> None:
        """Ends a `hold`: the deadline moves as much later as it lasted (unless that was less
        than HELD_COUNTED_S and the timer still runs: not worth a new one)."""
        if self._held_at is None:
            return
        held = self._loop.time() - self._held_at
        self._held_at = None
        if self._expired or (held <= HELD_COUNTED_S and self._timer is not None):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._when += held
        self._timer = self._loop.call_at(self._when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self._held_at is not None:  # not due while held, unless held too long
            if self._max_hold is None:
                return  # `release` sets the timer again
            too_long = self._held_at + self._max_hold
            if self._loop.time() < too_long:
                self._timer = self._loop.call_at(too_long, self._fire)
                return
            self.held_out = True
        self._expired = True
        self._task.cancel()

    def disarm(self) -> bool:
        """Stops the timer (once; later calls do nothing). True when the deadline had passed
        and cancelled the task, and no one else did: the CancelledError is this deadline's, to
        be raised as the caller's own timeout."""
        self._held_at = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            return False
        if not self._expired:
            return False
        self._expired = False
        return self._task.uncancel() <= self._cancelling


async def within(work: Awaitable[T], timeout_s: float) -> T:
    """`await work`, or TimeoutError after `timeout_s`: `asyncio.wait_for` without the task it
    makes for `work` (a cancellation from elsewhere is raised as it is)."""
    timer = Deadline(asyncio.get_running_loop().time() + timeout_s)
    try:
        return await work
    except asyncio.CancelledError:
        if timer.disarm():
            raise TimeoutError from None
        raise
    finally:
        timer.disarm()
