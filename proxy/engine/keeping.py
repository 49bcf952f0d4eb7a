"""A run's `keep` (a stored context's save, a stored response), awaited to its end whatever
happens to the run meanwhile (a save begun is finished, and the run is told as it ended), but
for the time its caller gives once the run is cancelled (the server's drain ending)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def to_its_end(
    task: asyncio.Future[None], grace_s: Callable[[], float | None] | None = None
) -> None:
    """Awaits `task` to its end, however often the run is cancelled meanwhile (a save begun is
    finished: cut, its run was told as cancelled while the backend kept it, or not); but for
    `grace_s()` at most once the run is cancelled, when that says a time (then it is cut: the
    server's drain gives the requests it stops a few seconds, and a backend that does not
    answer would hold one past them); then a cancellation goes on (the task's failure, if
    any, read by `ended_well`), else the task's failure is raised."""
    loop = asyncio.get_running_loop()
    cancelled = False
    deadline: float | None = None  # when the task is cut, once the run is cancelled
    while not task.done():
        wait_s = None if deadline is None else max(deadline - loop.time(), 0.0)
        try:
            await asyncio.wait({task}, timeout=wait_s)  # (cancelled, it lets the task go on)
        except asyncio.CancelledError:  # (asked each time: the client left, then the drain ended)
            cancelled = True
            grace = grace_s() if grace_s is not None and deadline is None else None
            if grace is not None:
                deadline = loop.time() + grace
            continue
        if deadline is not None and not task.done() and loop.time() >= deadline:
            task.cancel()
            grace_s = None  # (then waited for: it lets go at once)
            deadline = None
    if cancelled:
        raise asyncio.CancelledError
    task.result()


def ended_well(task: asyncio.Future[None] | None) -> bool:
    return task is not None and task.done() and not task.cancelled() and task.exception() is None
