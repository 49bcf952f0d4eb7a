"""What a request may make the served process's event loop wait for, measured as a client
sees it: the longest gap between answers to `GET /healthz`, asked every 10 ms, while the
requests run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import httpx
import pytest

from tests.scripted_upstream import ScriptedUpstream, say

pytestmark = pytest.mark.e2e


async def longest_gap(base: str, work: Awaitable[object]) -> float:
    """The longest time between two answers to `/healthz` while `work` runs."""
    gaps: list[float] = []

    async def poll(client: httpx.AsyncClient) -> None:
        last = time.monotonic()
        while True:
            await client.get("/healthz")
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            await asyncio.sleep(0.01)

    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        polling = asyncio.create_task(poll(client))
        await asyncio.sleep(0.1)
        try:
            await work
        finally:
            polling.cancel()
    return max(gaps)


def dense_policy(n: int) -> list[dict[str, str]]:
    """Four expressions of ~1,990 characters each (8,000 in all, the most one policy may
    hold), each ~30 ms of compiling in Python; distinct per `n`."""
    ones = ",".join(["1"] * 990)
    return [{"expr": f"1 in [{ones}] && {n * 4 + k} >= 0"} for k in range(4)]


async def test_expressions_are_compiled_off_the_event_loop(
    proxy_url: str, upstream: ScriptedUpstream
) -> None:
    """Twenty-four requests of such policies at once held `/healthz` 2.2-2.5 s; compiled in
    threads, 0.1-0.6 s on a busy host of two cores."""
    upstream.script(*[say("ok") for _ in range(24)])
    base = proxy_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:

        async def ask(n: int) -> httpx.Response:
            body = {
                "model": "scripted",
                "messages": [{"role": "user", "content": "hi"}],
                "loop": {"max_steps": 1, "stop_when": dense_policy(n)},
            }
            return await client.post("/v1/chat/completions", json=body)

        answers: list[httpx.Response] = []

        async def all_of_them() -> None:
            answers.extend(await asyncio.gather(*(ask(n) for n in range(24))))

        gap = await longest_gap(base, all_of_them())
    assert [a.status_code for a in answers] == [200] * 24, answers[0].text
    assert gap < 1.0, f"/healthz waited {gap * 1000:.0f} ms"
