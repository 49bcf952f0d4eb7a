"""Sync python tools run in threads of their own (`server.tool_threads`): tools stuck past their
timeout use up only those, so `/readyz` (the sqlite backend's thread) and other runs go on, and
a sync call that finds every thread stuck is a tool error at once, not a wait."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
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
        timed_out = sum("timed out" in o for o in outputs)
        refused = sum("no tool worker free" in o for o in outputs)
        assert timed_out >= 16  # server.tool_threads: those ran, the rest waited for them
        assert timed_out + refused == STUCK_CALLS  # each waiter timed out, or was refused

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


def nap(seconds: float) -> str:
    """A sync tool that takes a while and returns (a slow query, not a stuck one)."""
    time.sleep(seconds)
    return "rested"


def quits(code: int) -> str:
    """A tool that wraps a command line tool (`argparse` exits on bad arguments)."""
    sys.exit(code)


def finds_nothing() -> str:
    return next(name for name in ["a", "b"] if name == "c")  # StopIteration


async def quits_async(code: int) -> str:
    raise SystemExit(code)


def threaded(tmp_path: Path, tool_threads: int) -> dict[str, Any]:
    here = "tests.integration.test_tool_threads"
    own = {n: {"kind": "python", "callable": f"{here}:{n}", "timeout_s": 10} for n in OWN_TOOLS}
    return {
        "server": {"tool_threads": tool_threads},
        "state": {"backend": "sqlite", "path": str(tmp_path / "state.db")},
        "tools": own,
        "agents": {"a": {"model": "scripted", "tools": list(OWN_TOOLS)}},
    }


OWN_TOOLS = ("nap", "quits", "finds_nothing", "quits_async")


async def test_sync_calls_past_the_threads_wait_for_one_while_the_others_run(
    proxy_for: ProxyFactory, tmp_path: Path
) -> None:
    """Slow calls (not stuck ones) hold every thread: the next calls wait for one."""
    async with proxy_for(threaded(tmp_path, tool_threads=2)) as proxy:
        proxy.upstream.script(calls(*(Call("nap", {"seconds": 0.2}) for _ in range(6))), say("Ok."))
        r = await within(10, proxy.chat(model="a", messages=user("go"), loop={
            "parallel_tool_calls": True}))  # fmt: skip
        assert r.status_code == 200
        assert tool_outputs(proxy, 1) == ["rested"] * 6


@pytest.mark.parametrize("parallel", [False, True])
async def test_a_tool_that_exits_or_stops_iterating_is_a_tool_error_at_once(
    proxy_for: ProxyFactory, tmp_path: Path, parallel: bool
) -> None:
    """`sys.exit` in a tool (as argparse does) ends neither the process nor the run, and a
    `StopIteration` does not leave its caller waiting out the timeout (10 s)."""
    async with proxy_for(threaded(tmp_path, tool_threads=2)) as proxy:
        proxy.upstream.script(
            calls(
                Call("quits", {"code": 2}),
                Call("finds_nothing", {}),
                Call("quits_async", {"code": 3}),
            ),
            say("Carried on."),
        )
        r = await within(5, proxy.chat(model="a", messages=user("go"), loop={
            "parallel_tool_calls": parallel}))  # fmt: skip
        assert r.json()["choices"][0]["message"]["content"] == "Carried on."
        assert tool_outputs(proxy, 1) == [
            '{"error":"SystemExit: 2"}',
            '{"error":"StopIteration"}',
            '{"error":"SystemExit: 3"}',
        ]
