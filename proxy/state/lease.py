"""A lease kept alive while it is held: renewed every third of its length, so a crashed process
frees what it held within one lease, and a live one keeps it however long its run takes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from proxy.throttled_log import ThrottledWarnings

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def renewed(
    name: str, lease_s: float, renew: Callable[[], Awaitable[bool]]
) -> AsyncIterator[None]:
    """Calls `renew` every `lease_s / 3` seconds until the block ends or `renew` says the lease
    is lost (False). A failed renewal is retried at the next tick: the lease may still hold."""

    async def keep() -> None:
        while True:
            await asyncio.sleep(lease_s / 3)
            try:
                if not await renew():
                    log.warning(  # (a backend restarted without its keys: no one took it)
                        "the lease on %s was lost: the holder's save is refused if another "
                        "run changed or dropped it meanwhile",
                        name,
                    )
                    return
            except Exception as exc:  # the backend is down: the next tick tries again
                log.warning("renewing the lease on %s failed: %s", name, type(exc).__name__)

    task = asyncio.ensure_future(keep())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# Releases tried again at once, at most (each tries for as long as its lease lasts).
MAX_LATE_RELEASES = 128


class LateReleases:
    """Releases of leases that failed (the backend down for a moment), tried again in the
    background for as long as the lease would last: the next holder, in this process or
    another, need not wait the lease out. A release is safe to repeat: it lets go of the
    holder's own token only."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        # A backend back after an outage lets go of every lock held then: once a second.
        self._let_go = ThrottledWarnings(log)

    def retry(self, name: str, lease_s: float, let_go: Callable[[], Awaitable[object]]) -> None:
        if len(self._tasks) >= MAX_LATE_RELEASES:  # a backend down fails every take and release:
            return  # its leases run out, as they would have without a later try
        task = asyncio.ensure_future(self._again(name, lease_s, let_go))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _again(
        self, name: str, lease_s: float, let_go: Callable[[], Awaitable[object]]
    ) -> None:
        loop = asyncio.get_running_loop()
        until, wait = loop.time() + lease_s, 0.25
        while loop.time() + wait < until:
            await asyncio.sleep(wait)
            try:
                await let_go()
            except Exception:  # still down: later, less often
                wait = min(2 * wait, 2.0)
                continue
            self._let_go.warning("the lock on %s was let go on a later try", name)
            return

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
