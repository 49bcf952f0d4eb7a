"""Request and agent options: python conditions, parallel tool calls, cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from proxy.engine import events as ev
from proxy.engine.stop import StopReason
from tests.bodies import user
from tests.integration.conftest import Proxy, ProxyFactory
from tests.scripted_upstream import call, calls, keep, say

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
        proxy.upstream.script(keep(call("search_notes", query="Lima")))
        r = await proxy.chat(model="r", messages=user("Research Lima."))
    loop = r.json()["loop"]
    assert loop["stop_reason"] == "custom_condition"
    assert loop["stop_details"]["condition"] == "stop_when[0]"
    assert loop["steps"] == 2


def tool_results(loop: dict[str, Any]) -> list[str]:
    return [m["content"] for m in loop["messages"] if m["role"] == "tool"]


async def test_parallel_tool_calls_run_concurrently(proxy_for: ProxyFactory) -> None:
    # `meet` returns once all three calls are inside it at once; run one at a time, each would
    # give up after its timeout and say that it was alone.
    meet = call("meet", group="parallel", parties=3, timeout_s=2.0)
    async with proxy_for() as proxy:
        proxy.upstream.script(calls(meet, meet, meet), say("All met."))
        r = await proxy.chat(
            model="scripted",
            messages=user("Meet."),
            loop={"tools": ["meet"], "parallel_tool_calls": True, "include_messages": True},
        )
    loop = r.json()["loop"]
    assert loop["tool_calls"] == 3
    assert tool_results(loop) == ["3 of 3 inside at once"] * 3


async def test_without_parallel_tool_calls_the_calls_run_one_at_a_time(
    proxy_for: ProxyFactory,
) -> None:
    meet = call("meet", group="sequential", parties=2, timeout_s=0.2)
    async with proxy_for() as proxy:
        proxy.upstream.script(calls(meet, meet), say("Done."))
        r = await proxy.chat(
            model="scripted",
            messages=user("Meet."),
            loop={"tools": ["meet"], "include_messages": True},
        )
    loop = r.json()["loop"]
    assert loop["tool_calls"] == 2
    assert tool_results(loop) == ["1 of 2 inside at once"] * 2


async def test_a_client_that_goes_away_cancels_the_run(proxy_for: ProxyFactory) -> None:
    async with proxy_for() as proxy:
        proxy.upstream.script(call("sleep", seconds=30))
        body = {"model": "scripted", "loop": {"tools": ["sleep"]}, "messages": user("Wait.")}
        sent = await proxy.leaving(body, after_s=0.1)
        finished = proxy.observer.of(ev.RunFinished)
        report = (await proxy.client.get(f"/v1/runs/{finished[0].run_id}")).json()
        cut = proxy.metric("loopwarden_tool_calls_total", tool="sleep", outcome="error")
    assert [f.stop.reason for f in finished] == [StopReason.CANCELLED]
    assert sent == []
    assert (report["stop_reason"], report["tool_calls"]) == ("cancelled", 1)  # it had started
    assert cut == 1  # and is counted as a call that failed


async def test_the_time_budget_holds_while_a_tool_runs(proxy: Proxy) -> None:
    """`max_duration_s` ends a run whose tool is still running, not at the next step."""
    proxy.upstream.script(call("sleep", seconds=30))
    body = {
        "model": "scripted",
        "messages": user("Wait."),
        "loop": {"tools": ["sleep"], "stop_when": [{"max_duration_s": 0.3}]},
    }
    r = await asyncio.wait_for(proxy.client.post("/v1/chat/completions", json=body), 20)
    assert r.status_code == 200
    loop = r.json()["loop"]
    assert loop["stop_reason"] == "time_budget"
    assert loop["tool_calls"] == 1  # cut short, it ran
    assert 0.3 <= loop["stop_details"]["observed"] < 20
    assert r.json()["choices"][0]["finish_reason"] == "length"
    cut = proxy.metric("loopwarden_tool_calls_total", tool="sleep", outcome="timeout")
    assert cut == 1
    assert proxy.metric("loopwarden_tool_duration_seconds_count", tool="sleep") == 1


async def test_a_stored_context_keeps_the_calls_of_a_step_the_time_budget_cut(
    proxy: Proxy,
) -> None:
    """The call began, so its reply and the call, answered as cut short, are the context's:
    the next run's model knows it may have had effects (they were lost, and run again)."""
    proxy.upstream.script(replace(call("sleep", seconds=30), content="Waiting."), say("Done."))
    body = {
        "context_id": "cut",
        "model": "scripted",
        "message": "Wait.",
        "loop": {"tools": ["sleep"], "stop_when": [{"max_duration_s": 0.3}]},
    }
    r = await asyncio.wait_for(proxy.client.post("/chat", json=body), 20)
    assert r.json()["loop"]["stop_reason"] == "time_budget"
    stored = (await proxy.client.get("/v1/contexts/cut")).json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool"]
    assert stored[1]["content"] == "Waiting."
    assert stored[1]["tool_calls"][0]["function"]["name"] == "sleep"
    assert "Cut short" in stored[2]["content"]
    await proxy.client.post("/chat", json={"context_id": "cut", "message": "And?"})
    assert [m["role"] for m in proxy.upstream.bodies[-1]["messages"]] == [
        "user", "assistant", "tool", "user",
    ]  # fmt: skip
