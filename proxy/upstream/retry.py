"""When a failed upstream attempt is tried again, and how long to wait first."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class Retry(Exception):
    """An attempt that failed in a way worth another: `error` is what the step fails with when
    no attempt is left; `retry_after` the upstream's Retry-After header, as it came."""

    def __init__(self, error: Exception, retry_after: str | None = None) -> None:
        self.error = error
        self.retry_after = retry_after

    def delay_s(self, attempt: int, base_s: float, max_s: float) -> float:
        """The wait before attempt number `attempt` (1 for the first retry): what Retry-After
        asks, else exponential backoff with jitter; never more than `max_s`."""
        asked = retry_after_s(self.retry_after)
        if asked is None:
            asked = base_s * 2 ** (attempt - 1) * (0.5 + random.random() / 2)
        return min(asked, max_s)


def retry_after_s(value: str | None, now: datetime | None = None) -> float | None:
    """The seconds a Retry-After header asks for: delay-seconds or an HTTP date; at least 0, and
    `inf` for an infinite one. None when there is none, or it means nothing (`nan`, garbage)."""
    if not value:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    if math.isnan(seconds):
        return None
    return max(seconds, 0.0)
