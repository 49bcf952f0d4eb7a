"""A run's `keep` (a stored context's save), awaited to its end whatever happens to the run
meanwhile: a save begun is finished, and the run is told as it ended."""

from __future__ import annotations

import asyncio

# How long a keep under way is waited for once its run is cancelled: within the time the server
# gives the requests its drain's end stopped (`server.SETTLE_S`).
GRACE_S = 3.0


async def to_its_end(task: asyncio.Future[None], grace_s: float = GRACE_S) -> None:
    """Awaits `task` to its end, however often the run is cancelled meanwhile (a save begun is
    finished: cut, its run was told as cancelled while the backend kept it, or not), for
    `grace_s` at most once the run is cancelled (then it is cut: a backend that does not
    answer would hold the request past the time a server's drain gives it); then a
    cancellation goes on (the task's failure, if any, read by `ended_well`), else the task's
    failure is raised."""
    loop = asyncio.get_running_loop()
    cancelled = cut = False
    deadline = 0.0
    while not task.done():
        wait_s = max(deadline - loop.time(), 0.0) if cancelled and not cut else None
        try:
            await asyncio.wait({task}, timeout=wait_s)  # (cancelled, it lets the task go on)
        except asyncio.CancelledError:
            if not cancelled:
                cancelled, deadline = True, loop.time() + grace_s
            continue
        if cancelled and not cut and not task.done() and loop.time() >= deadline:
            task.cancel()
            cut = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


def ended_well(task: asyncio.Future[None] | None) -> bool:
    return task is not None and task.done() and not task.cancelled() and task.exception() is None
