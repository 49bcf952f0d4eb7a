"""Spans exported over OTLP/HTTP from a proxy process, configured only by `OTEL_*` variables,
to a receiver in the test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.requests import Request
from starlette.responses import Response

from tests.e2e.conftest import config_file, proxy_process, serving_post
from tests.scripted_upstream import ScriptedUpstream, call, say
from tests.tools import TOOLS

pytestmark = pytest.mark.e2e

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.resources: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    async def traces(self, request: Request) -> Response:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.body())
        with self.lock:
            for resource_spans in export.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append(span)
                        self.resources.append(resource)
        return Response(b"", media_type="application/x-protobuf")


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[str, Receiver]]:
    sink = Receiver()
    with serving_post("/v1/traces", sink.traces) as url:
        yield url, sink


def attributes(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        value = getattr(a.value, kind)
        out[a.key] = list(value.values) if kind == "array_value" else value
    return out


def test_a_run_arrives_as_one_trace_over_otlp_http(
    receiver: tuple[str, Receiver], upstream: ScriptedUpstream, tmp_path: Path
) -> None:
    url, sink = receiver
    config = {
        "upstreams": {"scripted": {"base_url": upstream.url, "max_retries": 0}},
        "default_upstream": "scripted",
        "tools": TOOLS,
        "agents": {"weather": {"model": "scripted", "tools": ["get_weather", "to_fahrenheit"]}},
        "state": {"backend": "memory"},
    }
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "loopwarden-e2e",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
    }
    upstream.script(
        call("get_weather", city="Oslo"), call("to_fahrenheit", celsius=4.0), say("39.2°F in Oslo.")
    )
    with proxy_process(config_file(tmp_path, config), env, health="/healthz") as base:
        with OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
            client.chat.completions.create(
                model="weather",
                messages=[{"role": "user", "content": "Oslo in Fahrenheit?"}],
                extra_headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with sink.lock:
                if any(s.name.startswith("invoke_agent") for s in sink.spans):
                    break
            time.sleep(0.05)
    spans = [s for s in sink.spans if s.trace_id.hex() == TRACE_ID]
    names = sorted(s.name for s in spans)
    assert names == [
        "POST /v1/chat/completions",
        "chat scripted",
        "chat scripted",
        "chat scripted",
        "execute_tool get_weather",
        "execute_tool to_fahrenheit",
        "invoke_agent weather",
    ]
    server = next(s for s in spans if s.name.startswith("POST"))
    run = next(s for s in spans if s.name.startswith("invoke_agent"))
    chats = [s for s in spans if s.name.startswith("chat")]
    assert server.parent_span_id.hex() == CLIENT_SPAN
    assert run.parent_span_id == server.span_id
    assert all(c.parent_span_id == run.span_id for c in chats)
    assert attributes(run)["loopwarden.stop_reason"] == "completed"
    assert attributes(run)["gen_ai.agent.name"] == "weather"
    assert set(sink.resources[0].items()) >= {("service.name", "loopwarden-e2e")}
    sent = [str(p).split("-") for p in upstream.traceparents]
    chat_ids = sorted(c.span_id.hex() for c in chats)
    assert sorted(p[2] for p in sent) == chat_ids
    assert all(p[1] == TRACE_ID for p in sent)
