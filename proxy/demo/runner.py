"""Runs the demo: the scripted model and the proxy on 127.0.0.1, then the sample runs."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from proxy.api.app import create_app
from proxy.config import parse_config
from proxy.demo.scenes import DEMO_CONFIG, SCENES, Scene
from proxy.demo.scripted_model import scripted_app
from proxy.demo.telemetry_view import changed, samples, span_tree


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve_in_thread(app: Any, port: int) -> Iterator[str]:
    """Serves an ASGI app with uvicorn on 127.0.0.1 until the block ends."""
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"server on port {port} did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def demo_config(upstream_url: str) -> dict[str, Any]:
    config = dict(DEMO_CONFIG)
    config["upstreams"] = {"scripted": {"base_url": f"{upstream_url}/v1", "max_retries": 0}}
    return config


def run_scene(client: httpx.Client, scene: Scene) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": scene.model,
        "messages": [{"role": "user", "content": scene.prompt}],
    }
    body["loop"] = {**scene.loop, "include_messages": True}
    response = client.post("/v1/chat/completions", json=body)
    data: dict[str, Any] = response.json()
    data["_status"] = response.status_code
    return data


def describe(scene: Scene, data: dict[str, Any]) -> str:
    loop = data.get("loop", {})
    if data.get("choices"):
        answer = data["choices"][0]["message"].get("content")
    else:
        answer = f"HTTP {data['_status']} {data.get('error', {}).get('code')}"
    lines = [
        f"── {scene.title} " + "─" * max(0, 60 - len(scene.title)),
        f"  model/agent : {scene.model}",
        setup(scene),
        f"  prompt      : {scene.prompt}",
        f"  answer      : {answer}",
        f"  stop_reason : {loop.get('stop_reason')}   steps: {loop.get('steps')}   "
        f"tool_calls: {loop.get('tool_calls')}   cost_usd: {loop.get('cost_usd')}",
    ]
    for message in loop.get("messages") or []:
        content = message.get("content") or ""
        if message.get("role") == "tool" and content.startswith('{"error"'):
            lines.append(f"  blocked     : {content}")
    details = loop.get("stop_details")
    if details:
        lines.append(f"  stop_details: {json.dumps(details)}")
    return "\n".join(lines)


def setup(scene: Scene) -> str:
    """What set the run up to stop as it does: the request's `loop`, else the agent's config
    (its tools, rules, limits and conditions)."""
    if scene.loop:
        return f"  loop        : {json.dumps(scene.loop)}"
    agent = {k: v for k, v in DEMO_CONFIG["agents"][scene.model].items() if k != "system_prompt"}
    agent.pop("model")
    return f"  agent config: {json.dumps(agent)}"


def main() -> int:
    with serve_in_thread(scripted_app(), free_port()) as upstream:
        exporter = InMemorySpanExporter()
        tracing = TracerProvider()
        tracing.add_span_processor(SimpleSpanProcessor(exporter))
        registry = CollectorRegistry()
        config = parse_config(demo_config(upstream))
        app = create_app(config, registry=registry, tracer_provider=tracing)
        with (
            serve_in_thread(app, free_port()) as proxy,
            httpx.Client(base_url=proxy, timeout=30, trust_env=False) as client,
        ):
            print(
                f"Loopwarden demo: proxy at {proxy}, scripted model at {upstream} (until it ends)\n"
            )
            before = samples(client.get("/metrics").text)
            ran = [(scene, run_scene(client, scene)) for scene in SCENES]
            after = samples(client.get("/metrics").text)
        spans = exporter.get_finished_spans()  # every run's, ended with the servers
        for scene, data in ran:
            print(describe(scene, data))
            print("  spans       :")
            tree = span_tree(spans, data.get("loop", {}).get("run_id"))
            print("\n".join(f"    {line}" for line in tree))
            print()
        print("── The metrics that changed (GET /metrics) " + "─" * 20)
        print("\n".join(changed(before, after)))
    return 0
