"""One run per stop reason, through HTTP: its count, its `invoke_agent` span and whether that
span is an error (SPEC §11). A new stop reason fails here until it has a run of its own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry.trace import StatusCode

from proxy.engine.stop import StopReason
from proxy.errors import StateUnavailable
from proxy.state.memory import MemoryStore
from tests.integration.conftest import Proxy, ProxyFactory
from tests.scripted_upstream import Keep, Turn, call, fail, keep, say

ERRORS = {
    "max_invocations",
    "nudges_exhausted",
    "upstream_error",
    "state_unavailable",
    "internal_error",
}
HI = [{"role": "user", "content": "hi"}]
# Cheap over a few steps, over its evaluation cost limit after about fifteen.
COSTLY = "steps.exists(a, steps.exists(b, steps.exists(c, {} < 0)))".format(
    " + ".join(["a.index + b.index + c.index"] * 10)
)
RESEARCH = [{"role": "user", "content": "Research Lima."}]
SEARCH = call("search_notes", query="Lima")
CLIENT_TOOL = {
    "type": "function",
    "function": {"name": "ask_user", "parameters": {"type": "object", "properties": {}}},
}


class DownStore(MemoryStore):
    """A state backend that cannot be reached."""

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int], ttl_s: float | None = None
    ) -> tuple[bool, dict[str, int]]:
        raise StateUnavailable("the state backend is unreachable")


class BrokenStore(MemoryStore):
    """A state backend with a bug in its thread counting."""

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int], ttl_s: float | None = None
    ) -> tuple[bool, dict[str, int]]:
        raise RuntimeError("bug")


@dataclass
class Case:
    body: dict[str, Any]
    turns: tuple[Turn | Keep, ...]
    status: int = 200
    store: Any = None
    leave_after_s: float | None = None  # the client disconnects


def loop(**options: Any) -> dict[str, Any]:
    return {
        "model": "scripted",
        "messages": RESEARCH,
        "loop": {"tools": ["search_notes"], **options},
    }


CASES: dict[str, Case] = {
    "completed": Case({"model": "weather", "messages": HI}, (say("Hi."),)),
    "terminal_tool": Case(
        {
            "model": "scripted",
            "messages": HI,
            "loop": {
                "tools": ["final_answer"],
                "terminating_config": {"tool_ids": ["final_answer"]},
            },
        },
        (say("Hi."), call("final_answer", answer="Hi!")),
    ),
    "client_tool_call": Case(
        {"model": "scripted", "messages": HI, "tools": [CLIENT_TOOL]}, (call("ask_user"),)
    ),
    "tool_called": Case(loop(stop_when=[{"has_tool_call": "search_notes"}]), (SEARCH,)),
    "max_steps": Case(loop(max_steps=2), (keep(SEARCH),)),
    "token_budget": Case(loop(stop_when=[{"max_tokens_used": 900}]), (keep(SEARCH),)),
    "cost_budget": Case(loop(stop_when=[{"max_cost": 0.002}]), (keep(SEARCH),)),
    "time_budget": Case(  # the budget cuts the step's call short
        loop(stop_when=[{"max_duration_s": 0.2}]), (say("Too late.").replace(after_s=30),)
    ),
    "finish_reason": Case(loop(stop_when=[{"finish_reason_is": "tool_calls"}]), (SEARCH,)),
    "custom_condition": Case(loop(stop_when=[{"expr": "size(steps) >= 2"}]), (keep(SEARCH),)),
    "tool_call_limit": Case(
        loop(tool_call_limits=[{"run_limit": 1, "exit_behavior": "end"}]), (keep(SEARCH),)
    ),
    "max_invocations": Case(
        {
            "model": "scripted",
            "messages": RESEARCH,
            "loop": {
                "tools": ["search_notes", "final_answer"],
                "terminating_config": {"tool_ids": ["final_answer"], "max_invocations": 2},
            },
        },
        (keep(SEARCH),),
        status=422,
    ),
    "nudges_exhausted": Case(
        {
            "model": "scripted",
            "messages": HI,
            "loop": {
                "tools": ["final_answer"],
                "terminating_config": {"tool_ids": ["final_answer"], "consecutive_nudges": 0},
            },
        },
        (say("Hi."),),
        status=422,
    ),
    "content_filter": Case(
        {"model": "scripted", "messages": HI}, (say("", finish_reason="content_filter"),)
    ),
    "upstream_error": Case({"model": "scripted", "messages": HI}, (fail(500, "down"),), status=500),
    "cancelled": Case(
        {"model": "scripted", "messages": HI, "loop": {"tools": ["sleep"]}},
        (call("sleep", seconds=30),),  # still running when the client leaves
        leave_after_s=0.1,
    ),
    "condition_error": Case(
        loop(stop_when=[{"expr": COSTLY}]),
        (keep(SEARCH),),
    ),
    "state_unavailable": Case(
        loop(thread_id="t-1", tool_call_limits=[{"thread_limit": 5}]),
        (SEARCH,),
        status=503,
        store=DownStore(),
    ),
    "internal_error": Case(
        loop(thread_id="t-1", tool_call_limits=[{"thread_limit": 5}]),
        (SEARCH,),
        status=500,
        store=BrokenStore(),
    ),
}


def test_every_stop_reason_has_a_case() -> None:
    assert set(CASES) == {reason.value for reason in StopReason}


async def run_case(proxy: Proxy, case: Case) -> None:
    if case.leave_after_s is not None:
        assert await proxy.leaving(case.body, case.leave_after_s) == []
        return
    r = await proxy.client.post("/v1/chat/completions", json=case.body)
    assert r.status_code == case.status, r.text


@pytest.mark.parametrize("reason", sorted(CASES))
async def test_each_stop_reason_is_counted_and_on_its_run_span(
    proxy_for: ProxyFactory, reason: str
) -> None:
    case = CASES[reason]
    async with proxy_for(store=case.store) as proxy:
        proxy.upstream.script(*case.turns)
        await run_case(proxy, case)
        runs = {
            sample.labels["stop_reason"]: sample.value
            for family in proxy.registry.collect()
            if family.name == "loopwarden_runs"
            for sample in family.samples
            if sample.name == "loopwarden_runs_total" and sample.value
        }
        assert runs == {reason: 1.0}
        (run,) = [s for s in proxy.spans() if s.name.startswith("invoke_agent")]
        assert run.attributes is not None
        assert run.attributes["loopwarden.stop_reason"] == reason
        failed = run.status.status_code is StatusCode.ERROR
        assert failed == (reason in ERRORS)
        (server,) = [s for s in proxy.spans() if s.name == "POST /v1/chat/completions"]
        assert server.attributes is not None
        code = server.attributes["http.response.status_code"]
        assert code == (499 if reason == "cancelled" else case.status)
        assert (server.status.status_code is StatusCode.ERROR) == (case.status >= 500)
        # A call the run's end cut short says which stop cut it, never a Python class's name.
        said = {dict(s.attributes or {}).get("error.type") for s in proxy.spans()}
        said |= {
            sample.labels["error_type"]
            for family in proxy.registry.collect()
            for sample in family.samples
            if sample.name == "gen_ai_client_operation_duration_seconds_count"
        }
        assert "CancelledError" not in said
