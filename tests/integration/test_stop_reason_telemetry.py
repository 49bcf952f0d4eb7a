"""One run per stop reason, through HTTP: its count, its `invoke_agent` span and whether that
span is an error (SPEC §11). A new stop reason fails here until it has a run of its own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.trace import StatusCode

from proxy.demo.scripted_model import complete
from proxy.engine.stop import StopReason
from proxy.state.memory import MemoryStore
from tests.integration.conftest import Proxy, ProxyFactory

ERRORS = {"max_invocations", "nudges_exhausted", "upstream_error", "internal_error"}
HI = [{"role": "user", "content": "hi"}]
KEEP = [{"role": "user", "content": "keep calling search_notes"}]
CLIENT_TOOL = {
    "type": "function",
    "function": {"name": "ask_user", "parameters": {"type": "object", "properties": {}}},
}


class BrokenStore(MemoryStore):
    """A state backend with a bug in its thread counting."""

    async def reserve(
        self, thread_id: str, limits: Mapping[str, int]
    ) -> tuple[bool, dict[str, int]]:
        raise RuntimeError("bug")


def refusing(request: httpx.Request) -> httpx.Response:
    reply = complete(orjson.loads(request.content))
    reply["choices"][0]["message"] = {"role": "assistant", "content": ""}
    reply["choices"][0]["finish_reason"] = "content_filter"
    return httpx.Response(200, json=reply)


def failing(request: httpx.Request) -> httpx.Response:
    return httpx.Response(500, json={"error": {"message": "down", "type": "server_error"}})


@dataclass
class Case:
    body: dict[str, Any]
    status: int = 200
    overrides: dict[str, Any] = field(default_factory=dict)
    upstream: Any = None
    store: Any = None
    leave_after_s: float | None = None  # the client disconnects


def loop(**options: Any) -> dict[str, Any]:
    return {"model": "scripted", "messages": KEEP, "loop": {"tools": ["search_notes"], **options}}


CASES: dict[str, Case] = {
    "completed": Case({"model": "weather", "messages": HI}),
    "terminal_tool": Case(
        {
            "model": "scripted",
            "messages": HI,
            "loop": {
                "tools": ["final_answer"],
                "terminating_config": {"tool_ids": ["final_answer"]},
            },
        }
    ),
    "client_tool_call": Case(
        {
            "model": "scripted",
            "messages": [{"role": "user", "content": "ask_user"}],
            "tools": [CLIENT_TOOL],
        }
    ),
    "tool_called": Case(loop(stop_when=[{"has_tool_call": "search_notes"}])),
    "max_steps": Case(loop(max_steps=2)),
    "token_budget": Case(loop(stop_when=[{"max_tokens_used": 900}])),
    "cost_budget": Case(loop(stop_when=[{"max_cost": 0.002}])),
    "time_budget": Case(loop(stop_when=[{"max_duration_s": 0.001}])),
    "finish_reason": Case(loop(stop_when=[{"finish_reason_is": "tool_calls"}])),
    "custom_condition": Case(loop(stop_when=[{"expr": "size(steps) >= 2"}])),
    "tool_call_limit": Case(loop(tool_call_limits=[{"run_limit": 1, "exit_behavior": "end"}])),
    "max_invocations": Case(
        {
            "model": "scripted",
            "messages": KEEP,
            "loop": {
                "tools": ["search_notes", "final_answer"],
                "terminating_config": {"tool_ids": ["final_answer"], "max_invocations": 2},
            },
        },
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
        status=422,
    ),
    "content_filter": Case({"model": "scripted", "messages": HI}, upstream=refusing),
    "upstream_error": Case({"model": "scripted", "messages": HI}, status=500, upstream=failing),
    "cancelled": Case(loop(), leave_after_s=0.1),
    "internal_error": Case(
        loop(thread_id="t-1", tool_call_limits=[{"thread_limit": 5}]),
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
    proxy_for: ProxyFactory, slow_search_notes: Callable[[float], None], reason: str
) -> None:
    case = CASES[reason]
    if case.leave_after_s is not None:
        slow_search_notes(30)  # the run is still going when the client leaves
    async with proxy_for(case.overrides, upstream=case.upstream, store=case.store) as proxy:
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
