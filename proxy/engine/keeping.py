"""A run's `keep` (a stored context's save), awaited to its end whatever happens to the run
meanwhile: a save begun is finished, and the run is told as it ended."""

from __future__ import annotations

import asyncio


async def to_its_end(task: asyncio.Future[None]) -> None:
    """Awaits `task` to its end, however often the run is cancelled meanwhile (a save begun is
    finished: cut, its run was told as cancelled while the backend kept it, or not); then a
    cancellation goes on (the task's failure, if any, read by `ended_well`), else the task's
    failure is raised."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})  # (cancelled, it lets the task go on)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


def ended_well(task: asyncio.Future[None] | None) -> bool:
    return task is not None and task.done() and not task.cancelled() and task.exception() is None
