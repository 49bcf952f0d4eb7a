"""Metric updates counted in plain numbers and handed to prometheus-client in batches.

Every prometheus-client update takes a lock, and under `serve --workers` also writes a
memory-mapped file: about 1 µs and 2 µs each, and a request makes fifteen or more of them. A
`Tally` counts on the event loop's thread alone, so it needs no lock: a series' pending amount
is a float (a histogram's: its bucket counts and sum) added to its prometheus-client series
when the metrics are read. Registered first on a registry, the tally is applied whenever that
registry is collected (a scrape, `get_sample_value`), so a scrape never misses an update of
its own process; and once a second (`apply_every`), so that under `serve --workers` a scrape
of any worker shows every worker's updates within a second.

Only the event loop's thread may count: the amounts are not guarded against other threads.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import Metric


class PendingCount:
    """A counter's or gauge's series: `inc` (a gauge's amount may be negative)."""

    __slots__ = ("amount", "series")

    def __init__(self, series: Any) -> None:
        self.series = series
        self.amount = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.amount += amount

    def dec(self, amount: float = 1.0) -> None:
        self.amount -= amount

    def apply(self) -> None:
        if self.amount:
            amount, self.amount = self.amount, 0.0
            self.series.inc(amount)


class PendingHistogram:
    """A histogram's series: `observe`, in the bucket prometheus-client would choose (the
    first whose upper bound is at least the value)."""

    __slots__ = ("bounds", "counts", "series", "total")

    def __init__(self, series: Any) -> None:
        self.series = series
        self.bounds: list[float] = series._upper_bounds  # ends with +Inf
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def apply(self) -> None:
        counts = self.counts
        if not any(counts):
            return
        self.counts, total, self.total = [0] * len(counts), self.total, 0.0
        # prometheus-client's own fields: `observe` would take one lock (or file write) per
        # observation; these take one per bucket per batch.
        self.series._sum.inc(total)
        for bucket, count in zip(self.series._buckets, counts, strict=True):
            if count:
                bucket.inc(count)


Pending = PendingCount | PendingHistogram


class Tally:
    """The pending updates of every series counted through it. A prometheus-client collector
    that yields no metric: collecting it applies them."""

    def __init__(self) -> None:
        self._pending: list[Pending] = []

    def count(self, series: Any) -> PendingCount:
        """A new pending count of a counter's or gauge's `series` (keep it: one per series)."""
        pending = PendingCount(series)
        self._pending.append(pending)
        return pending

    def histogram(self, series: Any) -> PendingHistogram:
        """A new pending count of a histogram's `series` (keep it: one per series)."""
        pending = PendingHistogram(series)
        self._pending.append(pending)
        return pending

    def apply(self) -> None:
        for pending in self._pending:
            pending.apply()

    def collect(self) -> Iterator[Metric]:
        self.apply()
        return iter(())

    async def apply_every(self, interval_s: float) -> None:
        """Applies every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.apply()
