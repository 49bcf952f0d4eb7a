"""Loopwarden's memory: held streams and many sequential runs, as the RSS of its process tree.

    python -m tests.bench.memory [--streams 1000] [--sequential 10000]

1. Opens `--streams` streamed chat requests at once against a slow upstream (the mock's chunks
   200 ms apart, so every stream stays open for seconds) and samples the RSS while they are all
   open: the peak is printed against the goal (300 MB for 1,000 streams).
2. Then runs `--sequential` plain JSON requests one after the other, with the RSS after every
   1,000: the series and its max/min are printed against the goal (flat within ±10 %).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import tempfile
import time
from pathlib import Path

import aiohttp

from tests.bench.load import chat_body
from tests.bench.processes import rss_bytes, running

MB = 1024 * 1024


class Held:
    """How many streams are open now, the most at once, and the ones that failed."""

    def __init__(self) -> None:
        self.open = self.most = self.failed = 0
        self.all_open = asyncio.Event()


async def hold(session: aiohttp.ClientSession, url: str, held: Held, total: int) -> None:
    body = chat_body("mock", stream=True)
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            held.failed += 1
            return
        await r.content.readline()  # the run is under way
        held.open += 1
        held.most = max(held.most, held.open)
        if held.open == total:
            held.all_open.set()
        try:
            async for _ in r.content:
                pass
        finally:
            held.open -= 1


async def streams(url: str, pid: int, total: int, sample_s: float) -> tuple[int, int, int]:
    """(peak RSS while all were open, most open at once, failed)."""
    held = Held()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        target = url + "/chat/completions"
        tasks = [asyncio.create_task(hold(session, target, held, total)) for _ in range(total)]
        peak = 0
        try:
            async with asyncio.timeout(60):
                await held.all_open.wait()
            deadline = time.monotonic() + sample_s
            while time.monotonic() < deadline and held.open == total:
                peak = max(peak, rss_bytes(pid))
                await asyncio.sleep(0.05)
        except TimeoutError:
            print(f"only {held.most} of {total} streams were open at once")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return peak, held.most, held.failed


async def sequential(url: str, pid: int, runs: int, every: int) -> list[int]:
    """The RSS after every `every` runs of `runs` plain JSON chats, one after the other."""
    series = []
    body = chat_body("mock", stream=False)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession() as session:
        for i in range(1, runs + 1):
            async with session.post(url + "/chat/completions", data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"run {i}: HTTP {r.status}")
            if i % every == 0:
                series.append(rss_bytes(pid))
    return series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--sequential", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1000, help="runs between RSS samples")
    parser.add_argument("--gap-ms", type=float, default=200.0, help="the mock's chunk gap")
    parser.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling, all open")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the servers inherit it
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    with tempfile.TemporaryDirectory() as folder, running(Path(folder)) as servers:
        slow = ("--chunks", "100", "--chunk-delay-ms", str(args.gap_ms))
        mock, _ = servers.mock("", *slow)
        bounds = {"max_concurrent_runs": max(1000, args.streams + 10)}
        url, pid = servers.loopwarden(mock, 1, "", bounds)
        idle = rss_bytes(pid)
        peak, most, failed = asyncio.run(streams(url, pid, args.streams, args.sample_s))
        series = asyncio.run(sequential(url, pid, args.sequential, args.every))
    print(f"Loopwarden RSS (process tree), idle: {idle / MB:.0f} MB")
    print(f"{args.streams} streams held open ({most} at once, {failed} failed), "
          f"{args.gap_ms:g} ms chunk gap: peak {peak / MB:.0f} MB "
          "(goal: ≤ 300 MB at 1,000 streams)")  # fmt: skip
    if series:
        points = ", ".join(
            f"{(i + 1) * args.every}: {rss / MB:.0f}" for i, rss in enumerate(series)
        )
        ratio = max(series) / min(series)
        print(f"{args.sequential} sequential runs, RSS MB after every {args.every}: {points}")
        print(f"max/min = {ratio:.3f} (goal: flat within ±10 %, ≤ 1.10)")


if __name__ == "__main__":
    main()
