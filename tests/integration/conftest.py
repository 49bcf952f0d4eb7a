"""The app in-process: a `ScriptedUpstream` as the upstream, respx for everything else."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import orjson
import pytest
import respx
import yaml
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Sampler
from prometheus_client import CollectorRegistry
from starlette.types import Message

from proxy.api.app import create_app
from proxy.cli import main
from proxy.config import parse_config
from proxy.config.state import StateConfig
from proxy.state.backend import open_store
from proxy.state.store import StateStore
from tests.fakes import RecordingObserver
from tests.scripted_upstream import ScriptedUpstream
from tests.tools import TOOLS

UPSTREAM = "http://upstream.test/v1"

BASE_CONFIG: dict[str, Any] = {
    "upstreams": {"main": {"base_url": UPSTREAM, "max_retries": 0}},
    "default_upstream": "main",
    "pricing": {"scripted": {"input": 1.0, "output": 4.0}},
    "tools": TOOLS,
    "state": {"backend": "memory"},
    "agents": {
        "weather": {"model": "scripted", "tools": ["get_weather", "to_fahrenheit"]},
    },
}


class Routing(httpx.AsyncBaseTransport):
    """Sends upstream traffic to the scripted upstream and the rest to a respx router."""

    def __init__(self, upstream: ScriptedUpstream, router: respx.MockRouter) -> None:
        self.upstream = httpx.ASGITransport(upstream.app)
        self.other = httpx.MockTransport(router.async_handler)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "upstream.test":
            return await self.upstream.handle_async_request(request)
        return await self.other.handle_async_request(request)


class Proxy:
    def __init__(
        self,
        client: httpx.AsyncClient,
        upstream: ScriptedUpstream,
        observer: RecordingObserver,
        spans: InMemorySpanExporter,
        registry: CollectorRegistry,
    ) -> None:
        self.client = client
        self.upstream = upstream
        self.observer = observer
        self.exporter = spans
        self.registry = registry

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def chat(self, **body: Any) -> httpx.Response:
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
        return await self.client.post("/v1/chat/completions", json=body)

    async def leaving(
        self,
        body: dict[str, Any],
        after_s: float,
        path: str = "/v1/chat/completions",
        method: str = "POST",
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> list[Message]:
        """Posts a chat completion (or `body` to `path`, or makes a `method` request there) and
        disconnects `after_s` later; gives what the app sent.
        (httpx's ASGI transport cannot disconnect: this talks ASGI to the app itself.)"""
        app = self.client._transport.app  # type: ignore[attr-defined]
        messages = [{"type": "http.request", "body": orjson.dumps(body), "more_body": False}]

        async def receive() -> Message:
            if messages:
                return messages.pop()
            await asyncio.sleep(after_s)
            return {"type": "http.disconnect"}

        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "headers": [(b"content-type", b"application/json"), *headers],
            "query_string": b"",
            "root_path": "",
            "scheme": "http",
            "server": ("proxy.test", 80),
            "http_version": "1.1",
        }
        await asyncio.wait_for(app(scope, receive, send), 5)
        return sent


ProxyFactory = Callable[..., Any]


@pytest.fixture
def router() -> respx.MockRouter:
    return respx.MockRouter(assert_all_called=False)


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    """The upstream of every proxy of the test; the test scripts its turns. A request beyond the
    script fails the test at teardown."""
    scripted = ScriptedUpstream()
    yield scripted
    scripted.check()


@pytest.fixture
def proxy_for(router: respx.MockRouter, upstream: ScriptedUpstream) -> ProxyFactory:
    """Builds a proxy: `overrides` merged over BASE_CONFIG; `handler` answers all outgoing HTTP
    instead of the scripted upstream and respx (for failures below HTTP, or other routes);
    `sampler` decides which traces are recorded (by default, as the request's parent says)."""

    @asynccontextmanager
    async def make(
        overrides: dict[str, Any] | None = None,
        handler: Callable[[httpx.Request], Any] | None = None,
        store: StateStore | None = None,
        sampler: Sampler | None = None,
    ) -> AsyncIterator[Proxy]:
        config = dict(BASE_CONFIG)
        for key, value in (overrides or {}).items():
            merged = isinstance(value, dict) and isinstance(config.get(key), dict)
            config[key] = {**config[key], **value} if merged else value
        observer = RecordingObserver()
        if handler is None:
            transport: httpx.AsyncBaseTransport = Routing(upstream, router)
        else:
            transport = httpx.MockTransport(handler)
        exporter = InMemorySpanExporter()
        tracing = TracerProvider(sampler=sampler)
        tracing.add_span_processor(SimpleSpanProcessor(exporter))
        registry = CollectorRegistry()
        app = create_app(
            parse_config(config),
            transport=transport,
            observers=[observer],
            registry=registry,
            tracer_provider=tracing,
            store=store,
        )
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://proxy.test"
            ) as client,
        ):
            yield Proxy(client, upstream, observer, exporter, registry)

    return make


@pytest.fixture
async def proxy(proxy_for: ProxyFactory) -> AsyncIterator[Proxy]:
    async with proxy_for() as p:
        yield p


class Checked(NamedTuple):
    status: int
    out: str
    err: str


CheckConfig = Callable[[str | dict[str, Any]], Checked]


@pytest.fixture
def check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> CheckConfig:
    """`loopwarden check` on a config file holding the YAML text, or the document, given."""

    def check(config: str | dict[str, Any]) -> Checked:
        path = tmp_path / "loopwarden.yaml"
        path.write_text(config if isinstance(config, str) else yaml.safe_dump(config))
        status = main(["check", "--config", str(path)])
        out, err = capsys.readouterr()
        return Checked(status, out, err)

    return check


def state(kind: str, tmp_path: Path, redis_url: str, prefix: str | None = None) -> StateStore:
    os.environ["LOOPWARDEN_TEST_REDIS"] = redis_url
    return open_store(
        StateConfig(
            backend=kind,  # type: ignore[arg-type]
            path=str(tmp_path / "state.db"),
            url_env="LOOPWARDEN_TEST_REDIS",
            key_prefix=prefix or f"test-{secrets.token_hex(4)}:",
        )
    )


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path, redis_url: str
) -> AsyncIterator[StateStore]:
    """Each state backend in turn."""
    opened = state(request.param, tmp_path, redis_url)
    yield opened
    await opened.close()
