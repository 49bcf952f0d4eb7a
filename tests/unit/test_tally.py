"""The tally: metric updates counted in plain numbers, applied to prometheus-client in batches,
must expose exactly what prometheus-client's own updates would."""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.telemetry.tally import Tally

BUCKETS = (0.1, 0.5, 1, 5)
# On a bound, between bounds, past the last one, zero, and a negative amount.
VALUES = (0.1, 0.3, 0.5, 0.50001, 1, 4.9, 5, 7, 1e9, 0, -2, 0.1)


def metrics(registry: CollectorRegistry) -> tuple[Counter, Gauge, Histogram]:
    return (
        Counter("calls", "Calls.", ["kind"], registry=registry),
        Gauge("open", "Open.", registry=registry),
        Histogram("wait_seconds", "Wait.", ["kind"], buckets=BUCKETS, registry=registry),
    )


def exposed(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")  # when the series was made: differs by a moment
    }


def test_a_tally_exposes_what_prometheus_client_would() -> None:
    direct = CollectorRegistry()
    counter, gauge, histogram = metrics(direct)
    tallied = CollectorRegistry()
    tally = Tally()
    tallied.register(tally)
    t_counter, t_gauge, t_histogram = metrics(tallied)
    pending_counts = {kind: tally.count(t_counter.labels(kind)) for kind in ("a", "b")}
    pending_waits = {kind: tally.histogram(t_histogram.labels(kind)) for kind in ("a", "b")}
    pending_open = tally.count(t_gauge)

    for i, value in enumerate(VALUES):
        kind = "ab"[i % 2]
        counter.labels(kind).inc(abs(value))
        pending_counts[kind].inc(abs(value))
        histogram.labels(kind).observe(value)
        pending_waits[kind].observe(value)
        gauge.inc(value)
        pending_open.inc(value)
        if i % 3 == 0:
            gauge.dec()
            pending_open.dec()

    assert exposed(tallied) == exposed(direct)
    at_most_a_tenth = ("wait_seconds_bucket", (("kind", "a"), ("le", "0.1")))
    assert exposed(direct)[at_most_a_tenth] == 2  # 0.1 and -2


def test_collecting_applies_the_pending_updates_once() -> None:
    registry = CollectorRegistry()
    tally = Tally()
    registry.register(tally)
    counter, _, histogram = metrics(registry)
    calls, waits = tally.count(counter.labels("a")), tally.histogram(histogram.labels("a"))
    calls.inc()
    waits.observe(0.3)

    assert registry.get_sample_value("calls_total", {"kind": "a"}) == 1
    assert registry.get_sample_value("calls_total", {"kind": "a"}) == 1  # not applied twice
    assert registry.get_sample_value("wait_seconds_count", {"kind": "a"}) == 1
    calls.inc(2)
    waits.observe(2)
    assert registry.get_sample_value("calls_total", {"kind": "a"}) == 3
    assert registry.get_sample_value("wait_seconds_sum", {"kind": "a"}) == 2.3
    assert registry.get_sample_value("wait_seconds_bucket", {"kind": "a", "le": "1.0"}) == 1


async def test_apply_every_applies_with_no_scrape_of_its_own() -> None:
    """As under `serve --workers`: the metrics are read elsewhere, where collecting does not
    apply this process's tally."""
    elsewhere = CollectorRegistry()  # the tally is not registered here
    tally = Tally()
    counter, _, _ = metrics(elsewhere)
    tally.count(counter.labels("a")).inc(5)
    assert elsewhere.get_sample_value("calls_total", {"kind": "a"}) == 0

    applying = asyncio.create_task(tally.apply_every(0.01))
    try:
        for _ in range(100):
            await asyncio.sleep(0.01)
            if elsewhere.get_sample_value("calls_total", {"kind": "a"}) == 5:
                break
        assert elsewhere.get_sample_value("calls_total", {"kind": "a"}) == 5
    finally:
        applying.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await applying
