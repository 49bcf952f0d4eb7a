"""Which span exporter the standard OTEL_* variables select, and provider names."""

from __future__ import annotations

import os

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased
from prometheus_client import CollectorRegistry

from proxy.config import Config
from proxy.telemetry.setup import (
    MAX_LISTED_TOOL_LABELS,
    build_telemetry,
    exporter_from_env,
    provider_name,
    tracer_provider_from_env,
)


@pytest.mark.parametrize(
    ("env", "kind"),
    [
        ({}, type(None)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, Http),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, Grpc),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, Grpc),
        ({"OTEL_TRACES_EXPORTER": "console"}, ConsoleSpanExporter),
        (
            {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
            type(None),
        ),
    ],
)
def test_the_exporter_follows_the_environment(env: dict[str, str], kind: type) -> None:
    assert isinstance(exporter_from_env(env), kind)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER: 'zipkin'"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
    ],
)
def test_an_unsupported_setting_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        exporter_from_env(env)


@pytest.mark.parametrize(
    ("url", "configured", "name"),
    [
        ("https://api.openai.com/v1", None, "openai"),
        ("https://openrouter.ai/api/v1", None, "openrouter"),
        ("https://x.openai.azure.com/openai", None, "azure.ai.openai"),
        ("http://127.0.0.1:8000/v1", None, "openai"),
        ("http://127.0.0.1:8000/v1", "vllm", "vllm"),
    ],
)
def test_provider_names(url: str, configured: str | None, name: str) -> None:
    assert provider_name(url, configured) == name


def test_the_sampler_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = tracer_provider_from_env(Config(), os.environ)
    assert isinstance(provider, TracerProvider)
    sampler = provider.sampler
    assert isinstance(sampler, ParentBased)
    assert "TraceIdRatioBased{0.25}" in sampler.get_description()
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    quiet = tracer_provider_from_env(Config(), os.environ)
    assert isinstance(quiet, TracerProvider)
    assert not quiet.get_tracer("t").start_span("s").is_recording()
    provider.shutdown()
    quiet.shutdown()


def test_the_tool_label_takes_a_bounded_number_of_listed_names() -> None:
    """A server that renames its tools at each list would add a label value (and a series per
    outcome and bucket) each time."""
    config = Config.model_validate(
        {"tools": {"mine": {"kind": "builtin", "builtin": "final_answer"}}}
    )
    telemetry = build_telemetry(config, CollectorRegistry(), TracerProvider(), {})
    labels = telemetry.metrics_observer.labels
    telemetry.label_tools(["mine", "listed"])
    for i in range(2 * MAX_LISTED_TOOL_LABELS):
        telemetry.label_tools(["mine", "listed", f"renamed_{i}"])
    assert (labels.tool("mine"), labels.tool("listed")) == ("mine", "listed")
    assert labels.tool("renamed_0") == "renamed_0"
    last = f"renamed_{MAX_LISTED_TOOL_LABELS - 2}"  # "listed" took one place
    assert labels.tool(last) == last
    assert labels.tool(f"renamed_{MAX_LISTED_TOOL_LABELS - 1}") == "other"
    assert len(labels.tools) == 1 + MAX_LISTED_TOOL_LABELS
