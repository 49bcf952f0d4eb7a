"""The run metrics of SPEC §11.2: observers that turn a run's events into series updates."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from proxy.engine import events as ev
from proxy.engine.stop import StopReason
from proxy.engine.values import ModelReply, ToolOutcome
from proxy.telemetry.error_types import cut_call_outcome, cut_short_by, error_type
from proxy.telemetry.metrics import OTHER, Labels, Metrics

# (agent, model) pairs whose series are kept looked up: the model is the client's to name.
MAX_SERIES_CACHED = 1024


class RunSeries:
    """The series one (agent, model) pair's runs update, each looked up the first time it is
    updated (a series appears in the exposition once it exists): a run's events then update
    them with no label lookups of their own."""

    __slots__ = ("agent", "by_reason", "calls", "common", "cost", "first_chunk", "metrics",
                 "model")  # fmt: skip

    def __init__(self, metrics: Metrics, labels: Labels, agent: str, model: str) -> None:
        self.metrics = metrics
        self.agent = agent
        self.model = labels.model(model)
        metrics.start_series([(agent, self.model)])  # (once a pair: rate() sees its first run)
        self.common = ("chat", labels.providers(model), self.model)
        self.calls: tuple[Any, Any, Any] | None = None  # duration, input and output tokens
        self.first_chunk: Any = None
        self.cost: Any = None
        self.by_reason: dict[StopReason, tuple[Any, Any, Any, Any]] = {}

    def replied(self, duration_s: float, reply: ModelReply) -> None:
        calls = self.calls
        if calls is None:
            m, common = self.metrics, self.common
            calls = self.calls = (
                m.child(m.operation, *common, ""),
                m.child(m.tokens, *common, "input"),
                m.child(m.tokens, *common, "output"),
            )
        duration, tokens_in, tokens_out = calls
        duration.observe(duration_s)
        tokens_in.observe(reply.usage.prompt_tokens)
        tokens_out.observe(reply.usage.completion_tokens)
        if reply.first_chunk_s is not None:
            if self.first_chunk is None:
                self.first_chunk = self.metrics.child(self.metrics.first_chunk, *self.common)
            self.first_chunk.observe(reply.first_chunk_s)

    def failed(self, duration_s: float, error: str) -> None:
        m = self.metrics
        m.child(m.operation, *self.common, error).observe(duration_s)

    def finished(self, event: ev.RunFinished) -> None:
        reason = event.stop.reason
        found = self.by_reason.get(reason)
        if found is None:
            m, agent, value = self.metrics, self.agent, reason.value
            found = self.by_reason[reason] = (
                m.child(m.runs, agent, self.model, value),
                m.child(m.run_duration, agent, value),
                m.child(m.run_steps, agent, value),
                m.child(m.run_tool_calls, agent, value),
            )
        runs, duration, steps, tool_calls = found
        runs.inc()
        duration.observe(event.duration_s)
        steps.observe(event.steps)
        tool_calls.observe(event.tool_calls)
        if event.cost_usd:
            if self.cost is None:
                self.cost = self.metrics.child(self.metrics.cost, self.agent, self.model)
            self.cost.inc(event.cost_usd)


class MetricsObserver:
    """Turns run events into metrics."""

    def __init__(self, metrics: Metrics, labels: Labels) -> None:
        self.metrics = metrics
        self.labels = labels
        self._series: dict[tuple[str, str], RunSeries] = {}  # (agent label, model) -> series
        self._runs: dict[str, RunSeries] = {}  # run id -> its series
        # The server calls running, by run id: call id -> (tool label, when it started).
        self._running: dict[str, dict[str, tuple[str, float]]] = {}
        # The model calls the run's end cut short, by run id: how long each took.
        self._cut_calls: dict[str, float] = {}
        self._handlers: dict[type, Callable[[Any], None]] = {
            ev.RunStarted: self._started,
            ev.ModelReplied: self._replied,
            ev.ModelFailed: self._failed,
            ev.ToolStarted: self._tool_started,
            ev.ToolExecuted: self._executed,
            ev.CallBlocked: self._blocked,
            ev.Nudged: self._nudged,
            ev.RunFinished: self._finished,
        }

    def on_event(self, event: ev.RunEvent) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def series(self, agent: str | None, model: str) -> RunSeries:
        key = (self.labels.agent(agent), model)
        found = self._series.get(key)
        if found is None:
            if len(self._series) >= MAX_SERIES_CACHED:
                self._series.clear()
            found = self._series[key] = RunSeries(self.metrics, self.labels, *key)
        return found

    def _run(self, run_id: str) -> RunSeries:
        found = self._runs.get(run_id)
        return found if found is not None else self.series(OTHER, OTHER)

    def _started(self, event: ev.RunStarted) -> None:
        self.metrics.in_flight.inc()
        self._runs[event.run_id] = self.series(event.agent, event.model)

    def _replied(self, event: ev.ModelReplied) -> None:
        self._run(event.run_id).replied(event.duration_s, event.reply)

    def _failed(self, event: ev.ModelFailed) -> None:
        if isinstance(event.error, asyncio.CancelledError):  # cut short by the run's end:
            self._cut_calls[event.run_id] = event.duration_s  # counted with its stop reason
            return
        self._run(event.run_id).failed(event.duration_s, error_type(event.error))

    def _tool_started(self, event: ev.ToolStarted) -> None:
        running = self._running.setdefault(event.run_id, {})
        running[event.call.id] = (self.labels.tool(event.call.name), time.monotonic())

    def _executed(self, event: ev.ToolExecuted) -> None:
        started = self._running.get(event.run_id, {}).pop(event.call.id, None)
        tool = started[0] if started is not None else self.labels.tool(event.call.name)
        self._tool_ended(tool, event.outcome, event.duration_s)

    def _tool_ended(self, tool: str, outcome: ToolOutcome, duration_s: float) -> None:
        m = self.metrics
        m.child(m.tool_calls, tool, outcome).inc()
        m.child(m.tool_duration, tool).observe(duration_s)

    def _cut_short(self, event: ev.RunFinished) -> None:
        """The server calls the run's end cut short (its time budget: `timeout`; the client
        gone, or a failure: `error`), counted as the calls that finished are."""
        running = self._running.pop(event.run_id, None)
        if not running:
            return
        outcome, now = cut_call_outcome(event.stop.reason), time.monotonic()
        for tool, started in running.values():
            self._tool_ended(tool, outcome, now - started)

    def _blocked(self, event: ev.CallBlocked) -> None:
        m = self.metrics
        m.child(m.tool_calls, self.labels.tool(event.call.name), event.outcome).inc()

    def _nudged(self, event: ev.Nudged) -> None:
        m = self.metrics
        m.child(m.nudges, self._run(event.run_id).agent).inc()

    def _finished(self, event: ev.RunFinished) -> None:
        series = self._runs.pop(event.run_id, None) or self.series(event.agent, event.model)
        self.metrics.in_flight.dec()
        series.finished(event)
        cut = self._cut_calls.pop(event.run_id, None)
        if cut is not None:
            series.failed(cut, cut_short_by(event.stop.reason))
        if event.run_id in self._running:
            self._cut_short(event)


class OverheadObserver:
    """`loopwarden_proxy_overhead_seconds` of the runs one route starts (the engine knows no
    routes: the app gives each route its own observer)."""

    def __init__(self, metrics: Metrics, route: str) -> None:
        self.histogram = metrics.child(metrics.overhead, route)

    def on_event(self, event: ev.RunEvent) -> None:
        if isinstance(event, ev.RunFinished):
            overhead = event.duration_s - event.upstream_s - event.tools_s
            self.histogram.observe(max(0.0, overhead))
