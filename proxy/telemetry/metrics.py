"""Prometheus metrics (SPEC §11.2): an observer of run events, plus the upstream and HTTP hooks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

from proxy import __version__
from proxy.engine.stop import StopReason
from proxy.telemetry.tally import Pending, Tally

OTHER = "other"
NO_AGENT = "none"
# Buckets of the GenAI semantic conventions (gen_ai.client.* metrics).
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216)
DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
RUN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
COUNT_BUCKETS = (0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89)
# Up to seconds: a state backend in trouble holds a run that long (the p99 panel reads them).
OVERHEAD_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
)  # fmt: skip
TOOL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Where prometheus-client's multiprocess mode keeps every process's metrics (`serve --workers`).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True, slots=True)
class Labels:
    """Keeps label values bounded: names outside the config become `other`, or, for a model,
    the price data's name of it (`model_label`)."""

    agents: frozenset[str]
    # The config's tools; the app adds the tools its MCP sources expose as they are listed.
    tools: set[str]
    model_label: Callable[[str], str | None]
    providers: Callable[[str], str]  # model -> gen_ai.provider.name

    def agent(self, name: str | None) -> str:
        if name is None:
            return NO_AGENT
        return name if name in self.agents else OTHER

    def tool(self, name: str) -> str:
        return name if name in self.tools else OTHER

    def model(self, name: str) -> str:
        return self.model_label(name) or OTHER


class Metrics:
    """Every metric of SPEC §11.2, registered on one registry, updated through its `tally`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # No `_created` series: one more for every counter and histogram series (the
        # stop-reason series at 0 among them), which multi-worker `/metrics` has not either.
        prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry
        self.tally = Tally()
        registry.register(self.tally)  # first: collecting the registry applies it first
        self._children: dict[tuple[int, tuple[str, ...]], Pending] = {}
        self.runs = Counter(
            "loopwarden_runs",
            "Runs, by why they stopped.",
            ["agent", "model", "stop_reason"],
            registry=registry,
        )
        self.run_duration = Histogram(
            "loopwarden_run_duration_seconds", "Wall time of a run.", ["agent", "stop_reason"],
            buckets=RUN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.run_steps = Histogram(
            "loopwarden_run_steps", "Steps (upstream calls) per run.", ["agent", "stop_reason"],
            buckets=COUNT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.run_tool_calls = Histogram(
            "loopwarden_run_tool_calls", "Executed server tool calls per run.",
            ["agent", "stop_reason"], buckets=COUNT_BUCKETS, registry=registry,
        )  # fmt: skip
        # With several workers (`serve --workers`) gauges are summed over the live ones.
        in_flight = Gauge(
            "loopwarden_runs_in_flight",
            "Runs under way.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.in_flight = self.tally.count(in_flight)
        self.tool_calls = Counter(
            "loopwarden_tool_calls",
            "Server tool calls, by outcome.",
            ["tool", "outcome"],
            registry=registry,
        )
        self.tool_duration = Histogram(
            "loopwarden_tool_duration_seconds", "Time to execute a server tool call.", ["tool"],
            buckets=TOOL_BUCKETS, registry=registry,
        )  # fmt: skip
        self.nudges = Counter(
            "loopwarden_nudges", "Nudges sent to the model.", ["agent"], registry=registry
        )
        self.cost = Counter(
            "loopwarden_cost_usd",
            "Cost of upstream calls, in USD.",
            ["agent", "model"],
            registry=registry,
        )
        genai = ["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model"]
        self.tokens = Histogram(
            "gen_ai_client_token_usage", "Tokens used per upstream call.",
            [*genai, "gen_ai_token_type"], buckets=TOKEN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.operation = Histogram(
            "gen_ai_client_operation_duration_seconds", "Duration of an upstream call.",
            [*genai, "error_type"], buckets=DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.first_chunk = Histogram(
            "gen_ai_client_operation_time_to_first_chunk_seconds",
            "Time from a streamed upstream request to its first chunk.",
            genai, buckets=DURATION_BUCKETS, registry=registry,
        )  # fmt: skip
        self.upstream_requests = Counter(
            "loopwarden_upstream_requests", "Upstream HTTP attempts, by result.",
            ["upstream", "status_class"], registry=registry,
        )  # fmt: skip
        self.http_requests = Counter(
            "loopwarden_http_requests",
            "HTTP requests served.",
            ["route", "method", "code"],
            registry=registry,
        )
        self.http_duration = Histogram(
            "loopwarden_http_request_duration_seconds", "Time to serve an HTTP request.",
            ["route", "method", "code"], buckets=RUN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.overhead = Histogram(
            "loopwarden_proxy_overhead_seconds",
            "Wall time of a run minus its upstream and tool time.", ["route"],
            buckets=OVERHEAD_BUCKETS, registry=registry,
        )  # fmt: skip
        self.state_data_lost = Counter(
            "loopwarden_state_data_lost",
            "Times redis was found to have lost the proxy's data (restarted empty, flushed, "
            "evicting): thread counts, contexts and stored responses began again.",
            registry=registry,
        )
        self.build_info = Gauge(
            "loopwarden_build_info",
            "The running version.",
            ["version"],
            registry=registry,
            multiprocess_mode="max",
        )
        self.build_info.labels(__version__).set(1)

    def child(self, metric: Any, *values: str) -> Any:
        """The series `metric.labels(*values)`, counted through the tally; cached, since label
        lookups take a lock."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            series, tally = metric.labels(*values), self.tally
            histogram = isinstance(metric, Histogram)
            found = tally.histogram(series) if histogram else tally.count(series)
            self._children[key] = found
        return found

    def start_series(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Every stop_reason series (and the nudge counter) at 0 for each (agent, model) pair."""
        for agent, model in pairs:
            self.nudges.labels(agent)
            for reason in StopReason:
                self.runs.labels(agent, model, reason.value)

    def upstream_attempt(self, upstream: str, status_class: str) -> None:
        self.child(self.upstream_requests, upstream, status_class).inc()


def exposition_registry(metrics: Metrics) -> CollectorRegistry:
    """What `/metrics` exposes: the metrics' registry, or, under `serve --workers`
    (prometheus-client's multiprocess mode), every worker's metrics read from the shared
    directory, this worker's pending updates applied first."""
    if not os.environ.get(MULTIPROC_ENV):
        return metrics.registry
    merged = CollectorRegistry()
    merged.register(metrics.tally)
    multiprocess.MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
    return merged
