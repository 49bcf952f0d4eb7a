"""What telemetry costs per run and per request, in microseconds of CPU, with no network noise.

    python -m tests.bench.telemetry_cost [--runs N]

Compare the figures with a whole request's CPU on `../shared/bench` (`compare.py` prints CPU
ms per request for the proxy's process).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NoOpTracerProvider
from prometheus_client import CollectorRegistry
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from proxy.config import parse_config
from proxy.engine import events as ev
from proxy.engine.stop import Stop, StopReason
from proxy.engine.usage import Usage
from proxy.engine.values import ModelRequest, ToolCall, ToolResult
from proxy.telemetry.http import HttpTelemetry
from proxy.telemetry.setup import Telemetry, build_telemetry
from tests.fakes import reply

CONFIG = parse_config(
    {
        "upstreams": {"openai": {"base_url": "http://127.0.0.1:9001/v1"}},
        "tools": {"final_answer": {"kind": "builtin"}},
        "agents": {"helper": {"model": "gpt-4o-mini", "tools": ["final_answer"]}},
    }
)
ROUTE = "/v1/chat/completions"


def pass_through() -> list[ev.RunEvent]:
    """One step, no tools: what a plain chat completion through the proxy emits."""
    request = ModelRequest("gpt-4o-mini", [{"role": "user", "content": "hi"}], [], step=1)
    return [
        ev.RunStarted("run_1", None, "gpt-4o-mini", None, 0.0),
        ev.StepStarted("run_1", 1, request, 0.0),
        ev.ModelReplied("run_1", 1, reply("hello", prompt=30, completion=7), 0.00002, 0.001),
        ev.RunFinished(
            "run_1", None, "gpt-4o-mini", Stop(StopReason.COMPLETED), 1, 0, Usage(30, 7, 37),
            0.00002, 0.0012, 0.001, 0.0, None,
        ),
    ]  # fmt: skip


def tool_loop(steps: int = 3) -> list[ev.RunEvent]:
    """`steps` steps, a tool call in each but the last, ended by the agent's terminal tool."""
    request = ModelRequest("gpt-4o-mini", [{"role": "user", "content": "hi"}], [], step=1)
    events: list[ev.RunEvent] = [ev.RunStarted("run_2", "helper", "gpt-4o-mini", "t", 0.0)]
    for step in range(1, steps + 1):
        call = ToolCall(f"call_{step}", "final_answer", '{"answer": "x"}')
        events += [
            ev.StepStarted("run_2", step, request, 0.0),
            ev.ModelReplied("run_2", step, reply(calls=[("final_answer", "{}")]), 0.0001, 0.001),
            ev.ToolExecuted("run_2", step, call, ToolResult("x", "ok"), 0.0001),
        ]
    events.append(
        ev.RunFinished(
            "run_2", "helper", "gpt-4o-mini", Stop(StopReason.TERMINAL_TOOL), steps, steps,
            Usage(90, 21, 111), 0.0003, 0.004, 0.003, 0.0003, None,
        )
    )  # fmt: skip
    return events


class Dropped(SpanExporter):
    """An exporter that sends nowhere: the cost left is making and queueing the spans."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def telemetry(
    traced: bool, sampled: float = 1.0
) -> tuple[Telemetry, TracerProvider | NoOpTracerProvider]:
    provider: TracerProvider | NoOpTracerProvider = NoOpTracerProvider()
    if traced:
        provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(sampled)))
        provider.add_span_processor(BatchSpanProcessor(Dropped()))
    built = build_telemetry(CONFIG, CollectorRegistry(), provider, {})
    return built, provider


def per_call_us(work: Callable[[], Any], runs: int) -> float:
    work()  # warm caches (metric children, price lookups)
    started = time.process_time()
    for _ in range(runs):
        work()
    return (time.process_time() - started) / runs * 1e6


def observer_costs(runs: int) -> list[tuple[str, float]]:
    rows = []
    metrics_only, _ = telemetry(traced=False)
    traced, provider = telemetry(traced=True)
    tenth, tenth_provider = telemetry(traced=True, sampled=0.1)
    # A request's span that was not sampled, current while its run goes on.
    unsampled = trace.NonRecordingSpan(
        trace.SpanContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, False)
    )
    for name, events in (("pass-through run", pass_through()), ("3-step tool run", tool_loop())):
        for what, observer, parent in (
            ("metrics", metrics_only.metrics_observer, None),
            ("spans", traced.tracing, None),
            ("spans (1 run in 10 sampled)", tenth.tracing, None),
            ("spans (its request not sampled)", traced.tracing, unsampled),
        ):

            def feed(observer: Any = observer, events: list[ev.RunEvent] = events) -> None:
                for event in events:
                    observer.on_event(event)

            token = otel_context.attach(trace.set_span_in_context(parent)) if parent else None
            rows.append((f"{name}: {what} observer", per_call_us(feed, runs)))
            if token is not None:
                otel_context.detach(token)
    for used in (provider, tenth_provider):
        if isinstance(used, TracerProvider):
            used.shutdown()
    return rows


async def asgi_app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def request_scope(traceparent: bytes) -> Scope:
    return {
        "type": "http",
        "method": "POST",
        "path": ROUTE,
        "scheme": "http",
        "headers": [
            (b"host", b"127.0.0.1:8080"),
            (b"content-type", b"application/json"),
            (b"authorization", b"Bearer sk-x"),
            (b"traceparent", traceparent),
        ],
    }


async def http_costs(runs: int) -> list[tuple[str, float]]:
    # The caller's trace context decides the server span's sampling (flags 01 or 00).
    sampled = request_scope(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    unsampled = request_scope(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00")

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        return None

    async def timed(app: Any, scope: Scope = sampled) -> float:
        await app(scope, receive, send)
        started = time.process_time()
        for _ in range(runs):
            await app(scope, receive, send)
        return (time.process_time() - started) / runs * 1e6

    routes = [Route(ROUTE, asgi_app, methods=["POST"])]
    bare = await timed(asgi_app)
    metrics_only, _ = telemetry(traced=False)
    traced, provider = telemetry(traced=True)
    tracer = provider.get_tracer("bench")
    with_metrics = await timed(HttpTelemetry(asgi_app, metrics_only.metrics, None, routes))
    with_spans = await timed(HttpTelemetry(asgi_app, traced.metrics, tracer, routes))
    not_sampled = await timed(HttpTelemetry(asgi_app, traced.metrics, tracer, routes), unsampled)
    if isinstance(provider, TracerProvider):
        provider.shutdown()
    return [
        ("HTTP request: metrics", with_metrics - bare),
        ("HTTP request: metrics and server span", with_spans - bare),
        ("HTTP request: metrics and server span (not sampled)", not_sampled - bare),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20000)
    runs = parser.parse_args(argv).runs
    rows = observer_costs(runs) + asyncio.run(http_costs(runs))
    print(f"{'telemetry work':60} {'CPU us':>8}")
    for name, us in rows:
        print(f"{name:60} {us:8.1f}")


if __name__ == "__main__":
    main()
