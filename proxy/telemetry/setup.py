"""Telemetry wired from the config and the standard `OTEL_*` environment variables."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.trace import NoOpTracerProvider
from opentelemetry.trace import TracerProvider as AnyTracerProvider
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.pricing import catalogued
from proxy.telemetry.metrics import Labels, Metrics
from proxy.telemetry.run_metrics import MetricsObserver
from proxy.telemetry.tracing import TracingObserver

CAPTURE_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
_PROVIDERS = {
    "api.openai.com": "openai",
    "openrouter.ai": "openrouter",
    "api.groq.com": "groq",
    "api.mistral.ai": "mistral_ai",
    "api.deepseek.com": "deepseek",
    "api.x.ai": "x_ai",
    "generativelanguage.googleapis.com": "gcp.gemini",
}


def provider_name(base_url: str, configured: str | None) -> str:
    if configured:
        return configured
    host = urlsplit(base_url).hostname or ""
    if host.endswith(".openai.azure.com"):
        return "azure.ai.openai"
    return _PROVIDERS.get(host, "openai")  # an OpenAI-compatible server


def exporter_kind(env: Mapping[str, str]) -> str | None:
    """Which exporter the environment asks for (`OTEL_TRACES_EXPORTER`: otlp | console | none;
    with it unset, OTLP when an endpoint is set, else none, so a proxy without a collector
    does not log export failures): `console`, `grpc`, `http/protobuf` or None. Raises
    ValueError, naming the variable, for a value it cannot be."""
    kind = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not kind:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        kind = "otlp" if endpoint else "none"
    if kind in ("none", "console"):
        return None if kind == "none" else kind
    if kind != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER: {kind!r} is not one of otlp, console, none")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not one of http/protobuf, grpc"
        )
    return protocol


def exporter_from_env(env: Mapping[str, str]) -> SpanExporter | None:
    """The exporter `exporter_kind` names."""
    kind = exporter_kind(env)
    if kind is None:
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http()


def tracer_provider_from_env(config: Config, env: Mapping[str, str]) -> AnyTracerProvider:
    """The SDK provider (its sampler from `OTEL_TRACES_SAMPLER*`), or a no-op one when traces
    are not exported."""
    exporter = exporter_from_env(env)
    if exporter is None:
        return NoOpTracerProvider()
    name = env.get("OTEL_SERVICE_NAME") or config.telemetry.service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


# The most names MCP sources' lists add to the `tool` label in a process's life.
MAX_LISTED_TOOL_LABELS = 512
# The price data's model names a process labels series with, beyond the config's own.
MAX_CATALOGUED_LABELS = 64


@dataclass(slots=True)
class Telemetry:
    metrics: Metrics
    metrics_observer: MetricsObserver
    tracing: TracingObserver
    tracer_provider: AnyTracerProvider
    listed_labels: int = 0  # names the sources' lists added to the `tool` label so far

    def label_tools(self, names: Iterable[str]) -> None:
        """Tools whose metrics carry their own name (the exposed tools of MCP sources), up to
        MAX_LISTED_TOOL_LABELS names beyond the config's: a server that names its tools anew
        at each list does not grow the label's values without end (the rest are `other`)."""
        tools = self.metrics_observer.labels.tools
        for name in names:
            if name in tools:
                continue
            if self.listed_labels >= MAX_LISTED_TOOL_LABELS:
                return
            tools.add(name)
            self.listed_labels += 1


def build_telemetry(
    config: Config,
    registry: CollectorRegistry,
    tracer_provider: AnyTracerProvider,
    env: Mapping[str, str] = os.environ,
) -> Telemetry:
    aliases = {
        alias.model: alias.upstream or config.default_upstream for alias in config.models.values()
    }

    endpoints: dict[str, tuple[str, str, int | None]] = {}  # once: observers ask every step
    for name, upstream in config.upstreams.items():
        parts = urlsplit(upstream.base_url)
        provider = provider_name(upstream.base_url, upstream.provider)
        port = parts.port or (443 if parts.scheme == "https" else 80)  # as the URL implies
        endpoints[name] = (provider, parts.hostname or "", port)

    def endpoint(model: str) -> tuple[str, str, int | None]:
        return endpoints[aliases.get(model, config.default_upstream)]

    agent_models = _agent_models(config)
    configured_models = {a.model for a in config.models.values()} | set(config.pricing)
    configured_models |= set(agent_models.values())

    named: set[str] = set()  # the price data's names given as labels

    def model_label(model: str) -> str | None:
        """A model the config names is its own label; another, the price data's name of it (a
        client's names are unbounded, the price data's not: but 1,925 of them made 45,000
        series), for the first MAX_CATALOGUED_LABELS such names."""
        if model in configured_models:
            return model
        name = catalogued(model)
        if name is None or name in named:
            return name
        if len(named) >= MAX_CATALOGUED_LABELS:
            return None
        named.add(name)
        return name

    labels = Labels(
        agents=frozenset(config.agents),
        tools=set(config.tools),
        model_label=model_label,
        providers=lambda model: endpoint(model)[0],
    )
    metrics = Metrics(registry)
    pairs = [(name, labels.model(m)) for name, m in agent_models.items()]
    metrics.start_series([*pairs, ("none", "other")])
    capture = config.telemetry.capture_content or env.get(CAPTURE_ENV, "").lower() == "true"
    tracer = tracer_provider.get_tracer("loopwarden")
    return Telemetry(
        metrics,
        MetricsObserver(metrics, labels),
        TracingObserver(tracer, endpoint, capture),
        tracer_provider,
    )


def _agent_models(config: Config) -> dict[str, str]:
    """Each agent's upstream model name."""
    out = {}
    for name, agent in config.agents.items():
        alias = config.models.get(agent.model)
        out[name] = alias.model if alias is not None else agent.model
    return out
