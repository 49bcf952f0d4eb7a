"""Spans (SPEC §11.1) and metrics (SPEC §11.2) of runs through the HTTP API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import genai_prices.data
import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import SpanKind, StatusCode

from proxy import __version__ as proxy_version
from proxy.engine.stop import StopReason
from proxy.pricing import catalogued
from proxy.telemetry.setup import MAX_CATALOGUED_LABELS
from tests.bodies import user
from tests.integration.conftest import Proxy, ProxyFactory
from tests.scripted_upstream import Keep, Turn, call, keep, say

WEATHER = "What is the weather in Paris in Fahrenheit?"
# The weather agent's three steps: two tool calls, then the answer.
PARIS: tuple[Turn, ...] = (
    call("get_weather", city="Paris"),
    call("to_fahrenheit", celsius=18.0),
    say("64.4°F in Paris."),
)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def by_name(spans: list[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


async def ask_weather(proxy: Proxy, traceparent: str) -> httpx.Response:
    """The weather agent's question, sent under the caller's `traceparent` (and baggage)."""
    body = {"model": "weather", "messages": user(WEATHER)}
    headers = {"traceparent": traceparent, "baggage": "user=alice,tenant=acme"}
    return await proxy.client.post("/v1/chat/completions", json=body, headers=headers)


async def test_a_run_is_one_span_tree_under_the_incoming_trace(proxy: Proxy) -> None:
    proxy.upstream.script(*PARIS)
    r = await ask_weather(proxy, TRACEPARENT)
    assert r.status_code == 200
    spans = proxy.spans()
    (server,) = by_name(spans, "POST /v1/chat/completions")
    (run,) = by_name(spans, "invoke_agent weather")
    chats = by_name(spans, "chat scripted")
    tools = by_name(spans, "execute_tool")
    assert {format(s.context.trace_id, "032x") for s in spans} == {TRACE_ID}
    assert server.kind is SpanKind.SERVER
    assert server.parent is not None
    assert format(server.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert run.parent is not None
    assert run.parent.span_id == server.context.span_id
    assert len(chats) == 3
    assert [t.name for t in tools] == ["execute_tool get_weather", "execute_tool to_fahrenheit"]
    assert all(
        s.parent is not None and s.parent.span_id == run.context.span_id for s in chats + tools
    )
    assert all(c.kind is SpanKind.CLIENT for c in chats)
    attrs = dict(run.attributes or {})
    assert attrs["gen_ai.agent.name"] == "weather"
    assert attrs["loopwarden.stop_reason"] == "completed"
    assert attrs["loopwarden.steps"] == 3
    assert attrs["loopwarden.tool_calls"] == 2
    assert attrs["loopwarden.run_id"] == r.json()["loop"]["run_id"]
    assert attrs["gen_ai.usage.input_tokens"] == r.json()["usage"]["prompt_tokens"]
    chat = dict(chats[0].attributes or {})
    assert chat["gen_ai.operation.name"] == "chat"
    assert chat["gen_ai.provider.name"] == "openai"
    assert chat["gen_ai.request.model"] == "scripted"
    assert chat["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert chat["server.address"] == "upstream.test"
    assert chat["server.port"] == 80  # as the base URL (http, no port) implies
    assert chat["loopwarden.step"] == 1
    assert chat["loopwarden.cost_usd"] > 0
    assert chat["gen_ai.usage.output_tokens"] > 0
    tool = dict(tools[0].attributes or {})
    assert tool["gen_ai.tool.type"] == "extension"
    assert tool["loopwarden.tool.outcome"] == "ok"
    assert "gen_ai.tool.call.arguments" not in tool
    assert "gen_ai.input.messages" not in chat
    assert server.status.status_code is StatusCode.UNSET
    # The upstream saw each chat span's own context, not the client's headers.
    sent = proxy.upstream.traceparents
    assert [str(p).split("-")[2] for p in sent] == [
        format(c.context.span_id, "016x") for c in chats
    ]
    # Nor the client's baggage (its user and tenant ids): not the provider's to read.
    assert [r.headers.get("baggage") for r in proxy.upstream.requests] == [None] * len(chats)


class CountingSampler(Sampler):
    """The default sampler (as the parent says, else sampled), counting the spans it is asked
    about: every span a request begins, recorded or not."""

    def __init__(self) -> None:
        self.sampler = ParentBased(ALWAYS_ON)
        self.asked: list[str] = []

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        self.asked.append(args[2])  # the span's name
        return self.sampler.should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return "counting"


async def test_a_request_left_out_of_the_traces_begins_no_span_of_its_run(
    proxy_for: ProxyFactory,
) -> None:
    """A request whose trace is not sampled costs its run no span work: its spans would not be
    recorded either. The upstream still hears, in the request's context, that it is not
    sampled; a sampled request gets every span."""
    sampler = CountingSampler()
    unsampled = f"00-{TRACE_ID}-00f067aa0ba902b7-00"
    async with proxy_for(sampler=sampler) as proxy:
        proxy.upstream.script(*PARIS, *PARIS)
        for traceparent in (unsampled, TRACEPARENT):
            assert (await ask_weather(proxy, traceparent)).status_code == 200
        spans = proxy.spans()
    assert sampler.asked[0] == "POST /v1/chat/completions"  # then the sampled request's 7
    assert sampler.asked[1:] == [s.name for s in sorted(spans, key=lambda s: s.start_time or 0)]
    assert len(spans) == 7
    sent = [str(p).split("-") for p in proxy.upstream.traceparents]
    assert [(trace, flags) for _, trace, _, flags in sent] == [(TRACE_ID, "00")] * 3 + [
        (TRACE_ID, "01")
    ] * 3


async def test_content_is_on_spans_only_when_opted_in(proxy_for: ProxyFactory) -> None:
    async with proxy_for({"telemetry": {"capture_content": True}}) as proxy:
        proxy.upstream.script(*PARIS)
        await proxy.chat(model="weather", messages=user(WEATHER))
        spans = proxy.spans()
    chat = dict(by_name(spans, "chat")[0].attributes or {})
    tool = dict(by_name(spans, "execute_tool")[0].attributes or {})
    assert json.loads(str(chat["gen_ai.input.messages"]))[-1]["content"] == WEATHER
    assert json.loads(str(tool["gen_ai.tool.call.arguments"])) == {"city": "Paris"}
    assert "celsius" in str(tool["gen_ai.tool.call.result"])


@pytest.mark.parametrize("captured", [False, True])
async def test_a_tool_errors_output_is_on_its_span_only_when_content_is_captured(
    proxy_for: ProxyFactory, captured: bool
) -> None:
    """An error's output is the tool's (an MCP server's `isError` text may hold anything)."""
    async with proxy_for({"telemetry": {"capture_content": captured}}) as proxy:
        proxy.upstream.script(call("get_weather", town="Paris"), say("Sorry."))
        await proxy.chat(model="weather", messages=user(WEATHER))
        (tool,) = by_name(proxy.spans(), "execute_tool")
    assert tool.status.status_code is StatusCode.ERROR
    assert (tool.attributes or {})["error.type"] == "tool_error"
    if captured:
        assert tool.status.description == "invalid arguments at city: Field required"
    else:
        assert tool.status.description == "tool_error"


async def test_a_budget_stop_is_not_an_error_and_its_condition_is_an_event(
    proxy: Proxy,
) -> None:
    proxy.upstream.script(keep(call("search_notes", query="Lima")))
    await proxy.chat(
        model="scripted",
        messages=user("Research Lima."),
        loop={"tools": ["search_notes"], "stop_when": [{"step_count_is": 2}]},
    )
    (run,) = by_name(proxy.spans(), "invoke_agent")
    assert run.status.status_code is StatusCode.UNSET
    (held,) = [e for e in run.events if e.name == "loopwarden.stop_condition.held"]
    assert dict(held.attributes or {})["loopwarden.condition.kind"] == "step_count_is"


async def test_a_failed_run_and_a_failed_tool_set_error_status(proxy: Proxy) -> None:
    proxy.upstream.script(say("Hello."))
    r = await proxy.chat(
        model="scripted",
        messages=user("Just say hello."),
        loop={
            "tools": ["final_answer", "search_notes"],
            "terminating_config": {"tool_ids": ["search_notes"], "consecutive_nudges": 0},
        },
    )
    assert r.status_code == 422
    (run,) = by_name(proxy.spans(), "invoke_agent")
    assert run.status.status_code is StatusCode.ERROR
    assert dict(run.attributes or {})["error.type"] == "max_consecutive_nudges_exceeded"


async def test_blocked_calls_are_run_events_and_counted_by_outcome(proxy: Proxy) -> None:
    rule = {"type": "max_count_per_step", "tool_name": "get_weather", "max_count_limit": 2}
    proxy.upstream.script(keep(call("get_weather", city="Lima")))
    await proxy.chat(
        model="weather", messages=user("Lima?"), loop={"max_steps": 4, "tool_rules": [rule]}
    )
    await proxy.chat(
        model="weather",
        messages=user("Lima?"),
        loop={"max_steps": 3, "tool_call_limits": [{"run_limit": 1}]},
    )
    first = by_name(proxy.spans(), "invoke_agent")[0]
    blocked = [e for e in first.events if e.name == "loopwarden.tool_call.blocked"]
    assert [dict(e.attributes or {})["loopwarden.tool.outcome"] for e in blocked] == [
        "blocked_rule",
        "blocked_rule",
    ]
    outcomes = {
        outcome: proxy.metric("loopwarden_tool_calls_total", tool="get_weather", outcome=outcome)
        for outcome in ("ok", "blocked_rule", "blocked_limit")
    }
    assert outcomes == {"ok": 3, "blocked_rule": 2, "blocked_limit": 2}


async def test_every_stop_reason_series_exists_at_zero_from_start_up(proxy: Proxy) -> None:
    for reason in StopReason:
        labels = {"agent": "weather", "model": "scripted", "stop_reason": reason.value}
        assert proxy.registry.get_sample_value("loopwarden_runs_total", labels) == 0.0
    assert proxy.metric("loopwarden_build_info", version=proxy_version) == 1


RUNS: list[tuple[str, tuple[Turn | Keep, ...], dict[str, Any], str]] = [
    ("completed", PARIS, {"model": "weather", "messages": user(WEATHER)}, "weather"),
    (
        "max_steps",
        (keep(call("get_weather", city="Lima")),),
        {"model": "weather", "messages": user("Lima?"), "loop": {"max_steps": 2}},
        "weather",
    ),
    (
        "tool_call_limit",
        (keep(call("get_weather", city="Lima")),),
        {
            "model": "weather",
            "messages": user("Lima?"),
            "loop": {"tool_call_limits": [{"run_limit": 1, "exit_behavior": "end"}]},
        },
        "weather",
    ),
    (
        "cost_budget",
        (keep(call("search_notes", query="Lima")),),
        {
            "model": "scripted",
            "messages": user("Research Lima."),
            "loop": {"tools": ["search_notes"], "stop_when": [{"max_cost": 0.002}]},
        },
        "none",
    ),
]


@pytest.mark.parametrize(("reason", "turns", "body", "agent"), RUNS, ids=[r[0] for r in RUNS])
async def test_runs_are_counted_by_stop_reason(
    proxy: Proxy,
    reason: str,
    turns: tuple[Turn | Keep, ...],
    body: dict[str, Any],
    agent: str,
) -> None:
    proxy.upstream.script(*turns)
    r = await proxy.client.post("/v1/chat/completions", json=body)
    assert r.json()["loop"]["stop_reason"] == reason
    labels = {"agent": agent, "model": "scripted", "stop_reason": reason}
    assert proxy.registry.get_sample_value("loopwarden_runs_total", labels) == 1
    assert proxy.metric("loopwarden_run_steps_count", agent=agent, stop_reason=reason) == 1
    assert proxy.metric("loopwarden_runs_in_flight") == 0
    assert (
        proxy.metric("loopwarden_proxy_overhead_seconds_count", route="/v1/chat/completions") == 1
    )
    steps = r.json()["loop"]["steps"]
    common = {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "openai",
        "gen_ai_request_model": "scripted",
    }
    assert (
        proxy.metric("gen_ai_client_token_usage_count", **common, gen_ai_token_type="input")
        == steps
    )
    assert (
        proxy.metric("gen_ai_client_operation_duration_seconds_count", **common, error_type="")
        == steps
    )
    assert (
        proxy.metric("loopwarden_upstream_requests_total", upstream="main", status_class="2xx")
        == steps
    )
    assert (
        proxy.metric(
            "loopwarden_http_requests_total",
            route="/v1/chat/completions",
            method="POST",
            code="200",
        )
        == 1
    )


async def test_unknown_agents_models_and_tools_are_folded_to_other(proxy: Proxy) -> None:
    proxy.upstream.script(say("Hi."))
    await proxy.chat(model="no-such-model-anywhere")
    labels = {"agent": "none", "model": "other", "stop_reason": "completed"}
    assert proxy.registry.get_sample_value("loopwarden_runs_total", labels) == 1


def model_labels(proxy: Proxy) -> set[str]:
    return {
        sample.labels["model"]
        for family in proxy.registry.collect()
        if family.name == "loopwarden_runs"
        for sample in family.samples
    }


async def test_a_model_the_price_data_knows_is_labelled_by_its_name_there(proxy: Proxy) -> None:
    """Names are the client's to choose, and the price data matches many by their start: 200
    names were 200 label values of every model series (`/metrics` grew without bound). Each is
    labelled as the price data names the model now, one of a bounded set."""
    proxy.upstream.script(*(say("Hi.") for _ in range(40)))
    for i in range(20):
        await proxy.chat(model=f"claude-3-5-sonnet-{i:08x}")
        await proxy.chat(model=f"gemini-1.5-pro-{i:08x}")
    assert model_labels(proxy) == {"scripted", "other", "claude-3-5-sonnet", "gemini-1.5-pro"}
    sent = {"agent": "none", "model": "claude-3-5-sonnet", "stop_reason": "completed"}
    assert proxy.registry.get_sample_value("loopwarden_runs_total", sent) == 20
    assert (
        proxy.metric(
            "gen_ai_client_token_usage_count",
            gen_ai_operation_name="chat",
            gen_ai_provider_name="openai",
            gen_ai_request_model="gemini-1.5-pro",
            gen_ai_token_type="input",
        )
        == 20
    )


async def test_the_price_data_s_names_label_series_up_to_a_bound(proxy: Proxy) -> None:
    """A client naming each of the price data's 1,925 models made 45,000 series (6.7 MB of
    `/metrics`): past MAX_CATALOGUED_LABELS of its names, a model is `other`."""
    names = sorted({m.id for p in genai_prices.data.providers for m in p.models})
    distinct = {}
    for name in names:
        if (label := catalogued(name)) is not None and label not in distinct.values():
            distinct[name] = label
        if len(distinct) > MAX_CATALOGUED_LABELS + 5:
            break
    proxy.upstream.script(*(say("Hi.") for _ in distinct))
    for name in distinct:
        await proxy.chat(model=name)
    labels = model_labels(proxy)
    assert labels - {"scripted", "other"} == set(list(distinct.values())[:MAX_CATALOGUED_LABELS])
    assert "other" in labels


async def test_a_pass_through_model_s_stop_reason_series_are_at_zero_from_its_first_run(
    proxy: Proxy,
) -> None:
    """Else `increase()` misses the first run that ends with each other reason."""
    proxy.upstream.script(say("Hi."))
    await proxy.chat(model="gpt-4o-mini")
    for reason in StopReason:
        labels = {"agent": "none", "model": "gpt-4o-mini", "stop_reason": reason.value}
        expected = 1.0 if reason is StopReason.COMPLETED else 0.0
        assert proxy.registry.get_sample_value("loopwarden_runs_total", labels) == expected


async def test_streamed_steps_record_time_to_first_chunk(proxy: Proxy) -> None:
    proxy.upstream.script(*PARIS)
    r = await proxy.chat(model="weather", messages=user(WEATHER), stream=True)
    assert r.status_code == 200
    common = {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "openai",
        "gen_ai_request_model": "scripted",
    }
    assert proxy.metric("gen_ai_client_operation_time_to_first_chunk_seconds_count", **common) == 3


async def test_nudges_and_cost_are_counted_per_agent(proxy: Proxy) -> None:
    proxy.upstream.script(say("Hello."), call("get_weather", city="Paris"))
    r = await proxy.chat(
        model="weather",
        messages=user("Just say hello."),
        loop={"terminating_config": {"tool_ids": ["get_weather"]}},
    )
    assert proxy.metric("loopwarden_nudges_total", agent="weather") == 1
    cost = proxy.metric("loopwarden_cost_usd_total", agent="weather", model="scripted")
    assert cost == pytest.approx(r.json()["loop"]["cost_usd"])


async def test_metrics_endpoint_serves_the_exposition(proxy: Proxy) -> None:
    proxy.upstream.script(*PARIS)
    await proxy.chat(model="weather", messages=user(WEATHER))
    r = await proxy.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    assert (
        'loopwarden_runs_total{agent="weather",model="scripted",stop_reason="completed"} 1.0'
        in r.text
    )


async def test_http_metrics_label_routes_by_their_template_and_fold_the_rest(
    proxy: Proxy,
) -> None:
    await proxy.client.get("/v1/contexts/ctx-1")
    await proxy.client.get("/no/such/path")
    for method in ("FROBNICATE", "BREW"):  # any token is a method a client may send
        await proxy.client.request(method, "/no/such/path")
    context = {"route": "/v1/contexts/{context_id}", "method": "GET", "code": "404"}
    assert proxy.metric("loopwarden_http_requests_total", **context) == 1
    other = {"route": "other", "method": "GET", "code": "404"}
    assert proxy.metric("loopwarden_http_requests_total", **other) == 1
    methods = {
        sample.labels["method"]
        for family in proxy.registry.collect()
        if family.name == "loopwarden_http_requests"
        for sample in family.samples
    }
    assert methods == {"GET", "_OTHER"}  # so label values stay bounded


class _CutShort(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'{"data": ['
        raise httpx.ReadError("reset")


@pytest.mark.parametrize("cut", [False, True])
async def test_a_relayed_answer_cut_short_fails_its_span(
    proxy_for: ProxyFactory, cut: bool
) -> None:
    """An upstream that failed mid-answer left the relayed answer cut, and its span OK."""

    def upstream(request: httpx.Request) -> httpx.Response:
        if cut:
            return httpx.Response(200, stream=_CutShort())
        return httpx.Response(200, json={"data": []})

    async with proxy_for(handler=upstream) as proxy:
        body, parent = {"model": "m", "input": "x"}, [(b"traceparent", TRACEPARENT.encode())]
        sent = await proxy.leaving(body, 5, "/v1/embeddings", headers=parent)
        assert sent[-1].get("more_body") is cut  # (cut: the answer never ended)
        (server,) = by_name(proxy.spans(), "POST ")  # (a relayed route: `other`)
    assert server.status.status_code is (StatusCode.ERROR if cut else StatusCode.UNSET)
    assert dict(server.attributes or {}).get("error.type") == ("cut_short" if cut else None)
