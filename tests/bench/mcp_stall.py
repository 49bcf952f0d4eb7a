"""How long a large MCP tool result holds the event loop: a stdio server's `large` tool answers
N MiB of text, read through the proxy's stdio transport and, for comparison, through the `mcp`
SDK's own stdio client. A 1 ms timer on the same loop measures the longest gap and the loop's
busy share while the call runs (medians of 3).

    python -m tests.bench.mcp_stall [--mib 1,4,8,15]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.stdio import stdio_client as sdk_stdio_client

from proxy.tools.mcp_stdio import stdio_client
from tests.mcp_config import SERVER

LIMIT = 16 * 1024 * 1024  # the default max_message_bytes
VALUES = 100_000  # the default server.max_body_values
TICK_S = 0.001


def ours() -> AbstractAsyncContextManager[tuple[Any, Any]]:
    command = [sys.executable, str(SERVER), "stdio"]
    return stdio_client(command, {}, LIMIT, VALUES, lambda _: None)


def sdk() -> AbstractAsyncContextManager[Any]:
    server = StdioServerParameters(command=sys.executable, args=[str(SERVER), "stdio"])
    return sdk_stdio_client(server)


TRANSPORTS: dict[str, Callable[[], AbstractAsyncContextManager[Any]]] = {
    "loopwarden": ours,
    "mcp SDK": sdk,
}


async def stall_of(call: Callable[[], Awaitable[object]]) -> tuple[float, float, float]:
    """The call's seconds, the longest gap of a TICK_S timer meanwhile, and the share of the
    time the loop was busy (not waiting for the timer or the pipe)."""
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    started = time.perf_counter()
    await call()
    took = time.perf_counter() - started
    done = True
    await ticker
    busy = sum(max(gap - TICK_S, 0.0) for gap in gaps)
    return took, max(gaps, default=0.0), min(busy / took, 1.0)


async def measure(mib: Sequence[float]) -> list[tuple[str, float, float, float, float]]:
    rows = []
    for name, transport in TRANSPORTS.items():
        async with Client(transport(), mode="auto") as client:
            await client.call_tool("large", {"kib": 1})  # warm
            for size in mib:
                call = functools.partial(client.call_tool, "large", {"kib": int(size * 1024)})
                runs = [await stall_of(call) for _ in range(3)]
                took, gap, busy = (statistics.median(r[i] for r in runs) for i in range(3))
                rows.append((name, size, took, gap, busy))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", default="1,4,8,15", help="result sizes, comma-separated")
    args = parser.parse_args(argv)
    sizes = [float(size) for size in args.mib.split(",")]
    print("| stdio client | result MiB | call ms | longest stall ms | loop busy |")
    print("|---|---|---|---|---|")
    for name, size, took, gap, busy in asyncio.run(measure(sizes)):
        print(f"| {name} | {size:g} | {took * 1000:,.0f} | {gap * 1000:,.0f} | {busy:.0%} |")


if __name__ == "__main__":
    main()
