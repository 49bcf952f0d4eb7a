"""Sync python tools run in threads of their own (`server.tool_threads`): tools stuck past their
timeout use up only those, so `/readyz` (the sqlite backend's thread) and other runs go on, and
a sync call that finds no thread free is a tool error at once, not a wait."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.bodies import user
from tests.integration.conftest import Proxy, ProxyFactory
from tests.scripted_upstream import Call, call, calls, say, say_tool_result
from tests.tools import TOOLS

RELEASE = threading.Event()
STUCK_CALLS = 34  # more than asyncio's default executor has threads on any machine of < 29 CPUs


def stuck() -> str:
    """A sync tool that hangs until the test ends (a blocking call that ignores its timeout)."""
    RELEASE.wait(60)
    return "unstuck"


@pytest.fixture(autouse=True)
def release_stuck_tools() -> Iterator[None]:
    RELEASE.clear()
    yield
    RELEASE.set()


def config(tmp_path: Path, **server: Any) -> dict[str, Any]:
    return {
        "server": server,
        "state": {"backend": "sqlite", "path": str(tmp_path / "state.db")},
        "tools": {
            **TOOLS,
            "stuck": {
                "kind": "python",
                "callable": "tests.integration.test_tool_threads:stuck",
                "timeout_s": 0.2,
            },
        },
        "agents": {"a": {"model": "scripted", "tools": ["stuck", "get_weather"]}},
    }


async def within(seconds: float, request: Any) -> httpx.Response:
    """The response, or a failure if it took longer than `seconds` (it was stalled)."""
    response: httpx.Response = await asyncio.wait_for(request, seconds)
    return response


def tool_outputs(proxy: Proxy, request: int) -> list[str]:
    messages = proxy.upstream.bodies[request]["messages"]
    return [m["content"] for m in messages if m["role"] == "tool"]


async def test_stuck_sync_tools_stall_neither_readyz_nor_other_runs(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    async with proxy_for(config(tmp_path)) as proxy:
        proxy.upstream.script(
            calls(*(Call("stuck") for _ in range(STUCK_CALLS))),
            say("they all hung"),
            call("get_weather", city="Oslo"),
            say_tool_result(),
        )
        first = await within(10, proxy.chat(model="a", messages=user("go")))
        assert first.status_code == 200
        outputs = tool_outputs(proxy, 1)
        assert sum("timed out" in o for o in outputs) == 16  # server.tool_threads
        assert sum("no tool worker free" in o for o in outputs) == STUCK_CALLS - 16

        ready = await within(5, proxy.client.get("/readyz"))
        assert ready.status_code == 200
        again = await within(5, proxy.chat(model="a", messages=user("Oslo?")))
        assert again.status_code == 200  # every tool thread is stuck: a tool error, no wait
        assert "no tool worker free" in again.json()["choices"][0]["message"]["content"]
        contexts = await within(5, proxy.client.get("/v1/contexts/nobody"))
        assert contexts.status_code == 404


async def test_a_sync_tool_runs_again_once_a_stuck_thread_returns(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    async with proxy_for(config(tmp_path, tool_threads=1)) as proxy:
        proxy.upstream.script(
            call("stuck"),
            say("hung"),
            call("get_weather", city="Oslo"),
            say_tool_result(),
            call("get_weather", city="Lima"),
            say_tool_result(),
        )
        assert (await within(10, proxy.chat(model="a", messages=user("go")))).status_code == 200
        busy = await within(5, proxy.chat(model="a", messages=user("Oslo?")))
        assert "all 1 tool threads are busy" in busy.json()["choices"][0]["message"]["content"]
        RELEASE.set()
        for _ in range(100):  # the stuck call returns and gives its thread back
            await asyncio.sleep(0.02)
            if not any(t.name == "loopwarden-call" for t in threading.enumerate()):
                break
        freed = await within(5, proxy.chat(model="a", messages=user("Lima?")))
        assert '"city":"Lima"' in freed.json()["choices"][0]["message"]["content"]
