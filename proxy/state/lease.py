"""A lease kept alive while it is held: renewed every third of its length, so a crashed process
frees what it held within one lease, and a live one keeps it however long its run takes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

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
