"""OpenTelemetry spans (SPEC §11.1) from run events: one `invoke_agent` span per run, one
`chat` span per step and one `execute_tool` span per executed server tool call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from proxy.engine import events as ev
from proxy.engine.values import ToolOutcome
from proxy.telemetry.error_types import cut_call_outcome, cut_short_by, error_type


@dataclass(slots=True)
class _RunSpans:
    run: Span
    chat: Span | None = None
    token: object | None = None  # the attached context of the chat span
    provider: str = "openai"
    server: tuple[str, int | None] = ("", None)
    # The `execute_tool` spans of calls under way, by call id, with their attached contexts
    # and the task each was attached in.
    tools: dict[str, tuple[Span, object, object]] = field(default_factory=dict)


class TracingObserver:
    """Spans for runs. `endpoint(model)` gives the provider name and upstream host and port."""

    def __init__(
        self,
        tracer: Tracer,
        endpoint: Callable[[str], tuple[str, str, int | None]],
        capture_content: bool = False,
    ) -> None:
        self.tracer = tracer
        self.endpoint = endpoint
        self.capture_content = capture_content
        self._runs: dict[str, _RunSpans] = {}

    def on_event(self, event: ev.RunEvent) -> None:
        if isinstance(event, ev.RunStarted):
            self._started(event)
            return
        spans = self._runs.get(event.run_id)
        if spans is None:
            return
        if isinstance(event, ev.StepStarted):
            self._step(spans, event)
        elif isinstance(event, ev.ModelReplied):
            self._replied(spans, event)
        elif isinstance(event, ev.ModelFailed):
            if not isinstance(event.error, asyncio.CancelledError):  # else: cut by the run's
                self._end_chat(spans, event.error)  # end, ended with it (its stop reason)
        elif isinstance(event, ev.ToolStarted):
            self._tool_started(spans, event)
        elif isinstance(event, ev.ToolExecuted):
            self._tool(spans, event)
        elif isinstance(event, ev.CallBlocked):
            spans.run.add_event(
                "loopwarden.tool_call.blocked",
                {
                    "gen_ai.tool.name": event.call.name,
                    "gen_ai.tool.call.id": event.call.id,
                    "loopwarden.tool.outcome": event.outcome,
                    "loopwarden.step": event.step,
                },
            )
        elif isinstance(event, ev.Nudged):
            spans.run.add_event("loopwarden.nudge", {"loopwarden.step": event.step})
        elif isinstance(event, ev.ConditionHeld):
            spans.run.add_event("loopwarden.stop_condition.held", _flat(event.details))
        elif isinstance(event, ev.ConditionFailed):
            attributes: dict[str, Any] = {
                "loopwarden.condition.condition": event.path,
                "loopwarden.step": event.step,
                "error.type": event.reason.split(":", 1)[0],
                "loopwarden.condition.error": event.reason,
            }
            spans.run.add_event("loopwarden.stop_condition.failed", attributes)
        elif isinstance(event, ev.RunFinished):
            self._finished(spans, event)

    def _started(self, event: ev.RunStarted) -> None:
        if _unsampled(trace.get_current_span()):
            return  # its request is not sampled: no span of the run would be either
        name = event.agent or event.model
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.request.model": event.model,
            "loopwarden.run_id": event.run_id,
        }
        if event.agent:
            attributes["gen_ai.agent.name"] = event.agent
        if event.thread_id:
            attributes["gen_ai.conversation.id"] = event.thread_id
        provider, host, port = self.endpoint(event.model)
        attributes["gen_ai.provider.name"] = provider
        span = self.tracer.start_span(
            f"invoke_agent {name}", kind=SpanKind.INTERNAL, attributes=attributes
        )
        self._runs[event.run_id] = _RunSpans(span, provider=provider, server=(host, port))

    def _step(self, spans: _RunSpans, event: ev.StepStarted) -> None:
        request = event.request
        host, port = spans.server
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": spans.provider,
            "gen_ai.request.model": request.model,
            "gen_ai.request.stream": request.stream,
            "server.address": host,
            "loopwarden.step": event.step,
        }
        if port is not None:
            attributes["server.port"] = port
        if request.max_completion_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = request.max_completion_tokens
        if self.capture_content:
            attributes["gen_ai.input.messages"] = orjson.dumps(request.messages).decode()
        parent = trace.set_span_in_context(spans.run)
        span = self.tracer.start_span(
            f"chat {request.model}", parent, kind=SpanKind.CLIENT, attributes=attributes
        )
        spans.chat = span
        # Current while the upstream call runs, so its request carries this span's context.
        spans.token = otel_context.attach(trace.set_span_in_context(span))

    def _replied(self, spans: _RunSpans, event: ev.ModelReplied) -> None:
        span, reply = spans.chat, event.reply
        if span is None:
            return
        # One `set_attributes`: each `set_attribute` takes the span's lock on its own.
        attributes: dict[str, Any] = {
            "gen_ai.usage.input_tokens": reply.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": reply.usage.completion_tokens,
        }
        if reply.response_model:
            attributes["gen_ai.response.model"] = reply.response_model
        if reply.response_id:
            attributes["gen_ai.response.id"] = reply.response_id
        if reply.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [reply.finish_reason]
        if event.cost_usd is not None:
            attributes["loopwarden.cost_usd"] = event.cost_usd
        if self.capture_content:
            attributes["gen_ai.output.messages"] = orjson.dumps([reply.message]).decode()
        span.set_attributes(attributes)
        self._end_chat(spans, None)

    def _end_chat(
        self, spans: _RunSpans, error: BaseException | None, cut_by: str | None = None
    ) -> None:
        if spans.token is not None:
            otel_context.detach(spans.token)  # type: ignore[arg-type]
            spans.token = None
        span, spans.chat = spans.chat, None
        if span is None:
            return
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
            span.set_attribute("error.type", error_type(error))
        elif cut_by is not None:
            span.set_status(Status(StatusCode.ERROR, cut_by))
            span.set_attribute("error.type", cut_by)
        span.end()

    def _tool_span(
        self, spans: _RunSpans, event: ev.ToolStarted | ev.ToolExecuted, start_time: int | None
    ) -> Span:
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": event.call.name,
            "gen_ai.tool.call.id": event.call.id,
            "gen_ai.tool.type": "extension",
            "loopwarden.step": event.step,
        }
        if self.capture_content:
            attributes["gen_ai.tool.call.arguments"] = event.call.arguments
        return self.tracer.start_span(
            f"execute_tool {event.call.name}",
            trace.set_span_in_context(spans.run),
            kind=SpanKind.INTERNAL,
            attributes=attributes,
            start_time=start_time,
        )

    def _tool_started(self, spans: _RunSpans, event: ev.ToolStarted) -> None:
        span = self._tool_span(spans, event, None)
        # Current while the tool runs (in the task that runs it), so that what the tool sends
        # carries this span's context (an MCP call's `params._meta.traceparent`).
        token = otel_context.attach(trace.set_span_in_context(span))
        spans.tools[event.call.id] = (span, token, _current_task())

    def _tool(self, spans: _RunSpans, event: ev.ToolExecuted) -> None:
        started = spans.tools.pop(event.call.id, None)
        end: int | None = None
        if started is None:  # no start was seen: the span is dated back from the duration
            end = time.time_ns()
            span = self._tool_span(spans, event, end - int(event.duration_s * 1e9))
        else:
            span, token, _ = started
            otel_context.detach(token)  # type: ignore[arg-type]
        span.set_attribute("loopwarden.tool.outcome", event.outcome)
        if self.capture_content:
            span.set_attribute("gen_ai.tool.call.result", event.result.output)
        if event.outcome != ToolOutcome.OK:
            kind = "timeout" if event.outcome == ToolOutcome.TIMEOUT else "tool_error"
            # The output is the tool's (an MCP server's `isError` text): content, on a span
            # only when `capture_content` says so.
            said = event.result.output[:200] if self.capture_content else kind
            span.set_status(Status(StatusCode.ERROR, said))
            span.set_attribute("error.type", kind)
        span.end(end_time=end)

    def _finished(self, spans: _RunSpans, event: ev.RunFinished) -> None:
        # A chat span still open failed with the run, or was cut short by its stop (the time
        # budget, the client gone): an error of that stop reason, as a tool call's is.
        self._end_chat(spans, event.error, cut_short_by(event.stop.reason))
        task = _current_task()
        for span, token, attached_in in spans.tools.values():  # calls cut short with the run
            if task is not None and attached_in is task:  # it ran in the run's own task
                otel_context.detach(token)  # type: ignore[arg-type]
            span.set_status(Status(StatusCode.ERROR, event.stop.reason.value))
            span.set_attribute("error.type", event.stop.reason.value)
            span.set_attribute("loopwarden.tool.outcome", cut_call_outcome(event.stop.reason))
            span.end()
        spans.tools.clear()
        del self._runs[event.run_id]
        span = spans.run
        attributes: dict[str, Any] = {
            "gen_ai.usage.input_tokens": event.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": event.usage.completion_tokens,
            "loopwarden.stop_reason": event.stop.reason.value,
            "loopwarden.steps": event.steps,
            "loopwarden.tool_calls": event.tool_calls,
        }
        if event.cost_usd is not None:
            attributes["loopwarden.cost_usd"] = event.cost_usd
        if event.stop.fails_run:
            span.set_status(Status(StatusCode.ERROR, event.stop.reason.value))
            attributes["error.type"] = event.stop.error_code or (
                error_type(event.error) if event.error else event.stop.reason.value
            )
        span.set_attributes(attributes)
        span.end()


def _current_task() -> asyncio.Task[Any] | None:
    """The task events come from; None outside an event loop (events fed by hand)."""
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def _unsampled(parent: Span) -> bool:
    """The run's parent (its request's span) was not sampled. The SDK's samplers that
    `OTEL_TRACES_SAMPLER` names decide once per trace (by the parent, or by the trace id), so
    the run's spans would not be sampled either: they are not made at all, and a request left
    out of the traces costs the run nothing. The request's own span is still current, and
    what the run sends upstream carries its context, which says "not sampled"."""
    context = parent.get_span_context()
    return context.is_valid and not context.trace_flags.sampled


def annotate_tool_span(attributes: Mapping[str, Any]) -> None:
    """Adds attributes to the current span: an MCP call's (`mcp.method.name`,
    `mcp.session.id`, `server.address`) to its `execute_tool` span."""
    trace.get_current_span().set_attributes(dict(attributes))


def inject_trace_headers(headers: dict[str, str]) -> None:
    """Adds the current span's context (the `chat` span) to an upstream request, with the
    propagators configured (`OTEL_PROPAGATORS`), and no baggage: the client's `baggage` (its
    user and tenant ids) is not the upstream provider's to read."""
    propagate.inject(headers, context=baggage.clear())


def _flat(details: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in details.items():
        if isinstance(value, bool | int | float | str):
            out[f"loopwarden.condition.{key}"] = value
        elif value is not None:
            out[f"loopwarden.condition.{key}"] = str(value)
    return out
