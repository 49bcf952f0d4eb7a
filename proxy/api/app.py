"""The starlette app: routes, the lifespan that wires the services, errors in one place."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Sequence

import httpx
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.trace import NoOpTracerProvider, TracerProvider
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.api.admission import Admission
from proxy.api.asgi import ErrorBoundary, Shutdown
from proxy.api.chat import ChatCompletions
from proxy.api.context_records import ContextRecords
from proxy.api.contexts import ContextRuns
from proxy.api.input_items import InputItems
from proxy.api.models import ModelList
from proxy.api.passthrough import METHODS, Passthrough
from proxy.api.probes import Probes
from proxy.api.responses import Responses, StoredResponses
from proxy.api.route_errors import EXCEPTION_HANDLERS
from proxy.api.runs import RunReports
from proxy.api.services import Services
from proxy.api.wiring import build_services
from proxy.config import Config
from proxy.engine.ports import RunObserver
from proxy.pricing import PriceTable
from proxy.state.backend import open_store
from proxy.state.sqlite_file import FileIdentity
from proxy.state.store import StateStore
from proxy.telemetry.http import HttpTelemetry
from proxy.telemetry.metrics import exposition_registry
from proxy.telemetry.run_metrics import OverheadObserver
from proxy.telemetry.setup import build_telemetry, tracer_provider_from_env
from proxy.telemetry.tracing import annotate_tool_span, inject_trace_headers
from proxy.tools.base import TOOL_KEEPALIVE_S
from proxy.tools.egress_routes import EgressRoutes
from proxy.tools.registry import SourcesUnavailable
from proxy.upstream.http1_transport import Http1Transport
from proxy.upstream.httpx_transport import HttpxTransport
from proxy.upstream.transport import Transport

log = logging.getLogger(__name__)


CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})
MODEL_PATH = "/v1/models/{model_id:path}"  # an id may hold slashes (`org/model`)
# Routes that start runs: each has its own run observers (the overhead metric's `route`).
RUN_ROUTES = (*CHAT_PATHS, *RESPONSES_PATHS, "/chat", "/chat/invoke", "/chat/add-ai-message")


class ProxyApp(Starlette):
    """Chat completions and responses skip starlette's middleware and router: they are the hot
    path."""

    chat: ASGIApp
    responses: ASGIApp
    served: ASGIApp  # `route` inside the error boundary, inside the HTTP telemetry
    services: Callable[[], Services]  # while the lifespan runs: the wired services

    start_up_told = False  # a start-up that failed for a reason the log has said already
    shutdown: Shutdown  # the server's, once it begins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.served(scope, receive, self._told_once(send))
            return
        await self.served(scope, receive, send)

    def _told_once(self, send: Send) -> Send:
        """The lifespan's messages, but the traceback of a start-up failure already told (the
        server would log it again, under the reason)."""

        async def sending(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed" and self.start_up_told:
                message = {**message, "message": ""}
            await send(message)

        return sending

    async def route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path in CHAT_PATHS:
                await self.chat(scope, receive, send)
                return
            if path in RESPONSES_PATHS:
                await self.responses(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def tools_transport(connections: int) -> httpx.AsyncBaseTransport:
    """The http tools' and webhooks' pools: the httpx API over aiohttp's connections, direct
    or through the environment's web proxy."""
    from httpx_aiohttp import AiohttpTransport

    limits = httpx.Limits(
        max_connections=connections,
        max_keepalive_connections=min(200, connections),
        keepalive_expiry=TOOL_KEEPALIVE_S,
    )
    return EgressRoutes(lambda proxy: AiohttpTransport(limits=limits, proxy=proxy))


def create_app(
    config: Config,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    observers: Sequence[RunObserver] = (),
    store: StateStore | None = None,
    registry: CollectorRegistry | None = None,
    tracer_provider: TracerProvider | None = None,
    state_file: FileIdentity | None = None,
) -> ProxyApp:
    """The proxy as an ASGI app. `transport` replaces the network, `store` the configured
    state backend, `registry` and `tracer_provider` the metrics and trace sinks (tests);
    `state_file`: the sqlite file a server's workers open (one gone is not made anew)."""
    holder: dict[str, Services] = {}
    shutdown = Shutdown()
    registry = registry if registry is not None else CollectorRegistry()
    own_tracing = tracer_provider is None
    tracing = tracer_provider or tracer_provider_from_env(config, os.environ)
    prices = PriceTable(config.pricing)
    telemetry = build_telemetry(config, registry, tracing)
    traced = not isinstance(tracing, NoOpTracerProvider)  # no exporter: no span work at all
    run_observers: list[RunObserver] = [telemetry.metrics_observer, *observers]
    if traced:
        run_observers.insert(1, telemetry.tracing)

    def services() -> Services:
        return holder["services"]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # The upstreams and the tools (http tools, webhooks) each have a pool of their own.
        network: Transport = (
            HttpxTransport(transport)
            if transport is not None
            else Http1Transport(config.server.upstream_connections)
        )
        tools_network = transport or tools_transport(config.server.tool_connections)
        timeout = httpx.Timeout(120.0, connect=10.0)
        try:
            lost = telemetry.metrics.state_data_lost.inc
            state = store or open_store(config.state, state_file, on_data_lost=lost)
        except ValueError as exc:  # (a sqlite file another process keeps in another mode)
            log.error("start-up failed:\n%s", exc)
            app.start_up_told = True  # type: ignore[attr-defined]
            raise
        try:
            async with (
                httpx.AsyncClient(transport=tools_network, timeout=timeout) as client,
                contextlib.aclosing(network),
            ):
                services = build_services(
                    config,
                    client,
                    network,
                    state,
                    run_observers,
                    {
                        route: [*run_observers, OverheadObserver(telemetry.metrics, route)]
                        for route in RUN_ROUTES
                    },
                    on_attempt=telemetry.metrics.upstream_attempt,
                    inject_headers=inject_trace_headers if traced else None,
                    prices=prices,
                    on_tool_call=annotate_tool_span if traced else None,
                    shutdown=shutdown,
                )
                registry = services.registry
                registry.listeners.append(lambda: telemetry.label_tools(registry.tools))
                telemetry.label_tools(registry.tools)
                try:
                    await services.open_sources()
                except SourcesUnavailable as exc:
                    log.error("start-up failed:\n%s", exc)
                    app.start_up_told = True  # type: ignore[attr-defined]
                    raise
                holder["services"] = services
                # Other workers' scrapes read this one's metrics from its files: applied there
                # once a second (and at the end); its own scrapes apply them first anyway.
                applying = asyncio.create_task(telemetry.metrics.tally.apply_every(1.0))
                try:
                    yield
                finally:
                    applying.cancel()
                    telemetry.metrics.tally.apply()
                    await services.threads.settle(config.state.timeout_s)
                    await services.reports.drain(config.state.timeout_s)
                    await services.close_sources()
        finally:
            holder.clear()
            if store is None:
                await state.close()
            if own_tracing and isinstance(tracing, SdkTracerProvider):
                tracing.shutdown()  # flushes the spans not yet exported

    probes = Probes(config, lambda: holder.get("services"), exposition_registry(telemetry.metrics))
    chat = ChatCompletions(services)
    responses = Responses(services)
    stored_responses = StoredResponses(services)
    input_items = InputItems(services)
    model_list = ModelList(services)
    runs = ContextRuns(services)
    routes = [
        Route("/chat", runs, methods=["POST"]),
        Route("/chat/invoke", runs, methods=["POST"]),
        Route("/chat/add-ai-message", runs, methods=["POST"]),
        Route("/v1/contexts/{context_id}", ContextRecords(services), methods=["GET", "DELETE"]),
        Route("/v1/runs/{run_id}", RunReports(services), methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_responses, methods=["GET", "DELETE"]),
        Route("/responses/{response_id}", stored_responses, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
        Route("/responses/{response_id}/input_items", input_items, methods=["GET"]),
        Route("/v1/models", model_list, methods=["GET"]),
        Route("/models", model_list, methods=["GET"]),
        Route(MODEL_PATH, model_list, methods=["GET"]),
        Route("/models/{model_id:path}", model_list, methods=["GET"]),
        Route("/metrics", probes.metrics, methods=["GET"]),
        Route("/healthz", probes.healthz, methods=["GET"]),
        Route("/readyz", probes.readyz, methods=["GET"]),
    ]
    # Other methods below /v1/models/ are the upstream's (deleting a fine-tuned model): relayed.
    own_paths = [route.path for route in routes if route.path != MODEL_PATH]
    routes.append(Route("/v1/{rest:path}", Passthrough(services, own_paths), methods=METHODS))
    app = ProxyApp(
        routes=routes,
        lifespan=lifespan,
        # Errors of routes behind starlette's router are rendered here, the same way the
        # `ErrorBoundary` renders the raw ASGI routes'.
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.chat = chat
    app.responses = responses
    app.services = services
    tracer = tracing.get_tracer("loopwarden") if traced else None
    app.shutdown = shutdown
    admitted = Admission(ErrorBoundary(app.route, shutdown), config.server, RUN_ROUTES)
    app.served = HttpTelemetry(admitted, telemetry.metrics, tracer, routes)
    return app
