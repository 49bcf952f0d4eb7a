"""Request and agent options: python conditions, parallel tool calls, cancellation."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import orjson

from proxy.demo.scripted_model import complete
from proxy.engine import events as ev
from proxy.engine.stop import StopReason
from tests.integration.conftest import ProxyFactory

SEEN: list[int] = []


def two_steps(snapshot: Mapping[str, Any]) -> bool:
    SEEN.append(len(snapshot["steps"]))
    return len(snapshot["steps"]) >= 2


async def test_python_condition_from_the_config(proxy_for: ProxyFactory) -> None:
    conditions = {
        "two": {"kind": "python", "callable": "tests.integration.test_run_options:two_steps"}
    }
    agents = {
        "r": {"model": "scripted", "tools": ["search_notes"], "stop_when": [{"python": "two"}]}
    }
    async with proxy_for({"conditions": conditions, "agents": agents}) as proxy:
        r = await proxy.chat(model="r", messages=[{"role": "user", "content": "keep search_notes"}])
    loop = r.json()["loop"]
    assert loop["stop_reason"] == "custom_condition"
    assert loop["stop_details"]["condition"] == "stop_when[0]"
    assert loop["steps"] == 2


async def test_parallel_tool_calls_run_concurrently(
    proxy_for: ProxyFactory, slow_search_notes: Callable[[float], None]
) -> None:
    slow_search_notes(0.2)

    def two_calls(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content)
        reply = complete(body)
        if not any(m["role"] == "tool" for m in body["messages"]):
            choice = reply["choices"][0]
            choice["message"]["content"] = None
            choice["message"]["tool_calls"] = [
                {
                    "id": f"c{i}",
                    "type": "function",
                    "function": {"name": "search_notes", "arguments": '{"query": "q"}'},
                }
                for i in range(3)
            ]
            choice["finish_reason"] = "tool_calls"
        return httpx.Response(200, json=reply)

    async with proxy_for(upstream=two_calls) as proxy:
        started = time.monotonic()
        r = await proxy.chat(
            model="scripted", loop={"tools": ["search_notes"], "parallel_tool_calls": True}
        )
        elapsed = time.monotonic() - started
    assert r.json()["loop"]["tool_calls"] == 3
    assert elapsed < 0.5  # three 0.2 s calls, side by side


async def test_a_client_that_goes_away_cancels_the_run(
    proxy_for: ProxyFactory, slow_search_notes: Callable[[float], None]
) -> None:
    slow_search_notes(30)
    async with proxy_for() as proxy:
        body = {
            "model": "scripted",
            "loop": {"tools": ["search_notes"]},
            "messages": [{"role": "user", "content": "search_notes"}],
        }
        sent = await proxy.leaving(body, after_s=0.1)
    finished = proxy.observer.of(ev.RunFinished)
    assert [f.stop.reason for f in finished] == [StopReason.CANCELLED]
    assert sent == []
