"""The metrics and tracing observers, fed hand-built event lists."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

from proxy.engine import events as ev
from proxy.engine.stop import Stop, StopReason
from proxy.engine.usage import Usage
from proxy.engine.values import ModelRequest, ToolCall, ToolResult
from proxy.errors import StateUnavailable, UpstreamStatusError
from proxy.telemetry.metrics import Labels, Metrics
from proxy.telemetry.run_metrics import MAX_SERIES_CACHED, MetricsObserver, OverheadObserver
from proxy.telemetry.tracing import TracingObserver
from tests.fakes import reply
from tests.unit.harness import Harness

CALL = ToolCall("call_1", "search", '{"q": "x"}')
OPERATION = {  # the series of `gen_ai_client_operation_duration_seconds` of the runs below
    "gen_ai_operation_name": "chat",
    "gen_ai_provider_name": "openai",
    "gen_ai_request_model": "gpt-x",
}


def run_events(stop: Stop, *, fail_step: bool = False) -> list[ev.RunEvent]:
    request = ModelRequest("gpt-x", [{"role": "user", "content": "hi"}], [], step=1)
    events: list[ev.RunEvent] = [
        ev.RunStarted("run_1", "agent-a", "gpt-x", "t-1", 0.0),
        ev.StepStarted("run_1", 1, request, 0.0),
        ev.ModelReplied(
            "run_1", 1, reply(calls=[("search", "{}")], prompt=30, completion=7), 0.002, 0.5
        ),
        ev.ToolExecuted("run_1", 1, CALL, ToolResult("boom", "timeout"), 0.25),
        ev.CallBlocked("run_1", 1, ToolCall("call_2", "mystery", "{}"), "blocked_limit", "no"),
        ev.Nudged("run_1", 1, "go on"),
        ev.StepStarted("run_1", 2, request, 1.0),
    ]
    if fail_step:
        events.append(ev.ModelFailed("run_1", 2, UpstreamStatusError(503, "busy"), 0.1))
    else:
        events.append(ev.ModelReplied("run_1", 2, reply("done"), 0.001, 0.25))
        events.append(
            ev.ConditionHeld("run_1", 2, {"condition": "stop_when[0]", "kind": "max_cost"})
        )
    error = UpstreamStatusError(503, "busy") if fail_step else None
    events.append(
        ev.RunFinished(
            "run_1", "agent-a", "gpt-x", stop, 2, 1, Usage(60, 12, 72), 0.003, 2.0, 0.75, 0.25,
            error,
        )
    )  # fmt: skip
    return events


def labels() -> Labels:
    return Labels(
        agents=frozenset({"agent-a"}),
        tools=frozenset({"search"}),
        model_label=lambda m: m if m == "gpt-x" else None,
        providers=lambda m: "openai",
    )


def test_metrics_from_one_run() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    observers = [
        MetricsObserver(metrics, labels()),
        OverheadObserver(metrics, "/v1/chat/completions"),
    ]
    for event in run_events(Stop(StopReason.COST_BUDGET)):
        for observer in observers:
            observer.on_event(event)

    def value(name: str, **kv: str) -> float | None:
        return registry.get_sample_value(name, kv)

    assert (
        value("loopwarden_runs_total", agent="agent-a", model="gpt-x", stop_reason="cost_budget")
        == 1
    )
    assert value("loopwarden_run_steps_sum", agent="agent-a", stop_reason="cost_budget") == 2
    assert value("loopwarden_runs_in_flight") == 0
    assert value("loopwarden_tool_calls_total", tool="search", outcome="timeout") == 1
    assert value("loopwarden_tool_calls_total", tool="other", outcome="blocked_limit") == 1
    assert value("loopwarden_tool_duration_seconds_sum", tool="search") == 0.25
    assert value("loopwarden_nudges_total", agent="agent-a") == 1
    assert value("loopwarden_cost_usd_total", agent="agent-a", model="gpt-x") == 0.003
    assert value("loopwarden_proxy_overhead_seconds_sum", route="/v1/chat/completions") == 1.0
    genai = {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "openai",
        "gen_ai_request_model": "gpt-x",
    }
    assert value("gen_ai_client_token_usage_sum", **genai, gen_ai_token_type="input") == 40
    assert value("gen_ai_client_operation_duration_seconds_count", **genai, error_type="") == 2


def test_a_failed_step_is_timed_with_its_error_type_and_unknown_names_fold() -> None:
    registry = CollectorRegistry()
    observer = MetricsObserver(Metrics(registry), labels())
    events = run_events(Stop(StopReason.UPSTREAM_ERROR), fail_step=True)
    events[0] = ev.RunStarted("run_1", "stranger", "gpt-x", None, 0.0)
    for event in events:
        observer.on_event(event)
    genai = {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "openai",
        "gen_ai_request_model": "gpt-x",
    }
    assert (
        registry.get_sample_value(
            "gen_ai_client_operation_duration_seconds_count", {**genai, "error_type": "503"}
        )
        == 1
    )
    assert registry.get_sample_value("loopwarden_nudges_total", {"agent": "other"}) == 1


def test_runs_of_many_client_model_names_fold_into_other_and_keep_few_series() -> None:
    registry = CollectorRegistry()
    observer = MetricsObserver(Metrics(registry), labels())
    runs = MAX_SERIES_CACHED + 100
    for i in range(runs):
        run_id, model = f"run_{i}", f"client-model-{i}"
        observer.on_event(ev.RunStarted(run_id, "agent-a", model, None, 0.0))
        observer.on_event(ev.ModelReplied(run_id, 1, reply("hi", prompt=3), 0.0, 0.1))
        observer.on_event(
            ev.RunFinished(
                run_id, "agent-a", model, Stop(StopReason.COMPLETED), 1, 0, Usage(3, 1, 4),
                None, 0.2, 0.1, 0.0,
            )
        )  # fmt: skip
        assert len(observer._series) <= MAX_SERIES_CACHED
    labels_ = {"agent": "agent-a", "model": "other", "stop_reason": "completed"}
    assert registry.get_sample_value("loopwarden_runs_total", labels_) == runs
    genai = {
        "gen_ai_operation_name": "chat",
        "gen_ai_provider_name": "openai",
        "gen_ai_request_model": "other",
        "gen_ai_token_type": "input",
    }
    assert registry.get_sample_value("gen_ai_client_token_usage_sum", genai) == 3 * runs
    # Runs that were never priced or streamed add no cost or first-chunk series, not even 0.
    samples = {m.name: m.samples for m in registry.collect()}
    assert samples["loopwarden_cost_usd"] == []
    assert samples["gen_ai_client_operation_time_to_first_chunk_seconds"] == []
    assert samples["loopwarden_runs"] != []


def traced(events: list[ev.RunEvent], capture: bool = False) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = TracingObserver(
        provider.get_tracer("test"), lambda m: ("openai", "api.example", 443), capture
    )
    for event in events:
        observer.on_event(event)
    return exporter


def test_spans_from_one_run() -> None:
    spans = {
        s.name: s for s in traced(run_events(Stop(StopReason.COST_BUDGET))).get_finished_spans()
    }
    run = spans["invoke_agent agent-a"]
    tool = spans["execute_tool search"]
    assert run.status.status_code is StatusCode.UNSET  # a budget stop is not an error
    assert dict(run.attributes or {})["gen_ai.conversation.id"] == "t-1"
    assert [e.name for e in run.events] == [
        "loopwarden.tool_call.blocked",
        "loopwarden.nudge",
        "loopwarden.stop_condition.held",
    ]
    assert tool.status.status_code is StatusCode.ERROR
    assert dict(tool.attributes or {})["error.type"] == "timeout"
    assert (tool.end_time or 0) - (tool.start_time or 0) == 250_000_000
    assert dict(spans["chat gpt-x"].attributes or {})["server.port"] == 443
    assert "gen_ai.tool.call.arguments" not in dict(tool.attributes or {})


def test_a_failed_run_ends_its_open_chat_span_with_the_error() -> None:
    spans = traced(run_events(Stop(StopReason.UPSTREAM_ERROR), fail_step=True)).get_finished_spans()
    failed_chat = [s for s in spans if s.name == "chat gpt-x"][-1]
    run = next(s for s in spans if s.name.startswith("invoke_agent"))
    assert failed_chat.status.status_code is StatusCode.ERROR
    assert dict(failed_chat.attributes or {})["error.type"] == "503"
    assert run.status.status_code is StatusCode.ERROR
    assert dict(run.attributes or {})["error.type"] == "503"


def test_a_call_cut_short_by_the_run_is_an_error_of_the_run_s_stop_reason() -> None:
    request = ModelRequest("gpt-x", [{"role": "user", "content": "hi"}], [], step=1)
    stop = Stop(StopReason.TIME_BUDGET)
    events: list[ev.RunEvent] = [
        ev.RunStarted("run_1", "agent-a", "gpt-x", None, 0.0),
        ev.StepStarted("run_1", 1, request, 0.0),
        ev.ModelReplied("run_1", 1, reply(calls=[("search", "{}")]), 0.002, 0.5),
        ev.ToolStarted("run_1", 1, CALL),
        ev.RunFinished(
            "run_1", "agent-a", "gpt-x", stop, 1, 1, Usage(1, 1, 2), None, 2.0, 0.5, 1.5, None
        ),
    ]
    spans = {s.name: s for s in traced(events).get_finished_spans()}
    tool = spans["execute_tool search"]
    assert tool.status.status_code is StatusCode.ERROR
    assert dict(tool.attributes or {})["error.type"] == "time_budget"


def test_a_failure_s_error_type_is_its_code_as_the_client_s_error_body_says_it() -> None:
    events = run_events(Stop(StopReason.STATE_UNAVAILABLE))
    finished = events[-1]
    assert isinstance(finished, ev.RunFinished)
    events[-1] = replace(finished, error=StateUnavailable("the state backend failed"))
    run = next(s for s in traced(events).get_finished_spans() if s.name.startswith("invoke_"))
    assert run.status.status_code is StatusCode.ERROR
    assert dict(run.attributes or {})["error.type"] == "state_unavailable"


def test_content_is_captured_only_when_asked() -> None:
    spans = traced(run_events(Stop(StopReason.COMPLETED)), capture=True).get_finished_spans()
    tool = next(s for s in spans if s.name.startswith("execute_tool"))
    assert dict(tool.attributes or {})["gen_ai.tool.call.arguments"] == '{"q": "x"}'


class StuckTools:
    """Tools whose calls never return: the run's time budget cuts them short."""

    async def check(self, call: ToolCall) -> dict[str, Any] | str:
        return {}

    async def execute(
        self, call: ToolCall, ctx: object, arguments: dict[str, Any] | None = None
    ) -> ToolResult:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


@pytest.mark.parametrize("calls", [1, 2])
async def test_a_tool_call_cut_short_leaves_no_span_current(calls: int) -> None:
    """A call the time budget cuts short ends its span with the run, and its span is not left
    current in the task that ran it (the run's own, for a lone call)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = TracingObserver(provider.get_tracer("t"), lambda model: ("openai", "h", 443))
    script = [reply(calls=[("search", "{}")] * calls)]
    h = Harness(
        script, {"search": lambda _: "x"}, stop_when=[{"max_duration_s": 0.1}], parallel=True
    )
    h.deps = replace(h.deps, tools=StuckTools(), clock=time.monotonic, observers=[observer])
    before = trace.get_current_span()
    result = await h.run()
    assert result.stop.reason is StopReason.TIME_BUDGET
    assert trace.get_current_span() is before
    tools = [s for s in exporter.get_finished_spans() if s.name.startswith("execute_tool")]
    assert len(tools) == calls
    assert all(s.status.status_code is StatusCode.ERROR for s in tools)
    # Every execute_tool span carries its outcome (SPEC §11.1): the metric's, `timeout`.
    assert [(s.attributes or {}).get("loopwarden.tool.outcome") for s in tools] == [
        "timeout"
    ] * calls


@pytest.mark.parametrize(
    ("reason", "cut_by"),
    [
        (StopReason.TIME_BUDGET, "time_budget"),
        (StopReason.CANCELLED, "cancelled"),
        # The final answer's call of a `max_steps` stop, cut by its time budget.
        (StopReason.MAX_STEPS, "time_budget"),
    ],
)
def test_a_model_call_cut_short_by_the_run_is_an_error_of_what_cut_it(
    reason: StopReason, cut_by: str
) -> None:
    """The time budget (or the client leaving) cancels the step's call: its span and its
    `error_type` say why, as a tool call's do, not `CancelledError`."""
    request = ModelRequest("gpt-x", [{"role": "user", "content": "hi"}], [], step=1)
    stop = Stop(reason)
    events: list[ev.RunEvent] = [
        ev.RunStarted("run_1", "agent-a", "gpt-x", None, 0.0),
        ev.StepStarted("run_1", 1, request, 0.0),
        ev.ModelFailed("run_1", 1, asyncio.CancelledError(), 0.5),
        ev.RunFinished("run_1", "agent-a", "gpt-x", stop, 1, 0, Usage(), None, 0.5, 0.5, 0.0, None),
    ]
    spans = {s.name: s for s in traced(events).get_finished_spans()}
    chat, run = spans["chat gpt-x"], spans["invoke_agent agent-a"]
    assert chat.status.status_code is StatusCode.ERROR
    assert dict(chat.attributes or {})["error.type"] == cut_by
    assert run.status.status_code is StatusCode.UNSET  # a limit stop is no error of the run
    registry = CollectorRegistry()
    observer = MetricsObserver(Metrics(registry), labels())
    for event in events:
        observer.on_event(event)
    name = "gen_ai_client_operation_duration_seconds_count"
    assert registry.get_sample_value(name, {**OPERATION, "error_type": cut_by}) == 1
    assert registry.get_sample_value(name, {**OPERATION, "error_type": "CancelledError"}) is None


def test_the_proxy_overhead_is_told_up_to_seconds() -> None:
    """Its buckets stopped at 0.25 s: a run held by a state backend's timeouts was `+Inf`,
    and the p99 panel read 0.25 s."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.overhead.labels("/v1/chat/completions").observe(2.0)
    name, route = "loopwarden_proxy_overhead_seconds_bucket", "/v1/chat/completions"
    below = registry.get_sample_value(name, {"route": route, "le": "1.0"})
    within = registry.get_sample_value(name, {"route": route, "le": "2.5"})
    assert (below, within) == (0.0, 1.0)
