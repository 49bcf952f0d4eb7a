"""What a burst of small requests continuing one large stored conversation costs the process:
each request is a few bytes, but each reads the stored conversation through the response it
continues (up to a request body's bytes) and parses it. Printed: the peak RSS over the burst,
the RSS after it, the longest gap of a 1 ms ticker on the same loop (the stall every other
request saw), the burst's wall and CPU time and the statuses.

    python -m tests.bench.read_burst [--mib 7] [--requests 48] [--upstream-ms 50]

The app runs in this process (memory state backend), its upstream an in-process fake that
answers after `--upstream-ms`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry

from proxy.api.app import create_app
from proxy.api.runtime import settle_runtime
from proxy.config import parse_config
from tests.bench.body_stall import CONFIG, PROSE, answered, ticking
from tests.bench.policy_cost import ANSWER, JSON

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * PAGE


class PeakRss:
    """The highest RSS seen, sampled every 2 ms on a thread of its own."""

    def __init__(self) -> None:
        self.peak = rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self.peak = max(self.peak, rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()


async def burst(mib: float, requests: int, upstream_ms: float) -> dict[str, Any]:
    async def answer(_: httpx.Request) -> httpx.Response:
        await asyncio.sleep(upstream_ms / 1000)
        return httpx.Response(200, content=ANSWER, headers=JSON)

    app = create_app(
        parse_config(CONFIG), transport=httpx.MockTransport(answer), registry=CollectorRegistry()
    )
    prose = {"role": "user", "content": PROSE}
    items = [prose] * int(mib * 1024 * 1024 // len(orjson.dumps(prose)))
    async with app.router.lifespan_context(app):
        settle_runtime()
        first = orjson.loads(
            await answered(app, orjson.dumps({"model": "m", "input": items}), "/v1/responses")
        )
        del items
        follow = orjson.dumps({"model": "m", "input": "?", "previous_response_id": first["id"]})
        await answered(app, follow, "/v1/responses")  # warmed up
        before = rss()
        async with ticking() as gaps:
            started, cpu = time.perf_counter(), time.process_time()
            with PeakRss() as peak:
                replies = await asyncio.gather(
                    *(answered(app, follow, "/v1/responses") for _ in range(requests))
                )
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        statuses = collections.Counter(
            orjson.loads(reply).get("status", "error") for reply in replies
        )
        return {
            "rss before MB": before / 1e6,
            "peak MB": peak.peak / 1e6,
            "after MB": rss() / 1e6,
            "longest stall ms": max(gaps) * 1e3,
            "wall ms": wall * 1e3,
            "cpu ms": cpu * 1e3,
            "statuses": dict(statuses),
        }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="read_burst")
    parser.add_argument("--mib", type=float, default=7.0, help="the stored conversation")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--upstream-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    row = asyncio.run(burst(args.mib, args.requests, args.upstream_ms))
    print(
        f"{args.requests} continuations of a {args.mib:g} MiB stored conversation, "
        f"upstream {args.upstream_ms:g} ms:"
    )
    for name, value in row.items():
        print(f"  {name:18} {value:.1f}" if isinstance(value, float) else f"  {name:18} {value}")


if __name__ == "__main__":
    main()
