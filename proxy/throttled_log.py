"""Warnings of one kind told at most once a second, each with the count of those not told since
it: a failure every request meets (an upstream down, a tool server refusing) is one line a
second in the log, not one a request."""

from __future__ import annotations

import logging
import math
import time


class ThrottledWarnings:
    def __init__(self, log: logging.Logger, interval_s: float = 1.0) -> None:
        self.log = log
        self.interval_s = interval_s
        self.told_at = -math.inf
        self.untold = 0

    def warning(self, message: str, *args: object) -> None:
        if self.due():
            self.log.warning(message + "%s", *args, self.told())

    def due(self) -> bool:
        """Whether one is told now (then with `told()`), else counted as not told."""
        now = time.monotonic()
        if now - self.told_at < self.interval_s:
            self.untold += 1
            return False
        self.told_at = now
        return True

    def told(self) -> str:
        """What follows the one told: the count of those not told since the last."""
        return self._untold()

    def close(self, message: str, *args: object) -> None:
        """The count of the warnings not told yet, if any, told with `message`."""
        if self.untold:
            self.log.warning(message + "%s", *args, self._untold())

    def _untold(self) -> str:
        untold, self.untold = self.untold, 0
        return f" ({untold} more since the last told)" if untold else ""


def described(error: BaseException) -> str:
    """An error as a warning tells it: its class, then its message on one line, cut to 300
    characters."""
    said = str(error).replace("\n", " ")[:300]
    return f"{type(error).__name__}: {said}" if said else type(error).__name__
