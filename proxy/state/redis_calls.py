"""Calling a redis server: its failures as `StateUnavailable`, TTLs in milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from redis.exceptions import RedisError

from proxy.errors import StateUnavailable
from proxy.state.store import check_ttl
from proxy.throttled_log import ThrottledWarnings

log = logging.getLogger(__name__)
# An outage fails every request's calls: told once a second, with the count of the others.
failures = ThrottledWarnings(log)


@contextlib.contextmanager
def reached() -> Iterator[None]:
    """Turns the server's failures into `StateUnavailable` (their details go to the log only:
    they name hosts), and raises the cancellation the client may have dropped: it sends each
    command under `asyncio.wait_for`, which on Python 3.11 returns as if nothing happened when
    the task is cancelled as the write completes (and a run whose client left would go on).
    Only a cancellation asked for during the call is raised: cleanup that runs while an earlier
    one is handled goes on."""
    task = asyncio.current_task()
    asked = task.cancelling() if task is not None else 0
    try:
        yield
    except RedisError as exc:
        if task is not None and task.cancelling() > asked:
            raise asyncio.CancelledError from None  # what made the call fail, most likely
        failures.warning("the redis state backend failed: %s: %s", type(exc).__name__, exc)
        raise StateUnavailable(
            f"the state backend (redis) is unavailable: {type(exc).__name__}"
        ) from None
    if task is not None and task.cancelling() > asked:
        raise asyncio.CancelledError


def ms(ttl_s: float) -> int:
    return max(1, round(check_ttl(ttl_s) * 1000))
