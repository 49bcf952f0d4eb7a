"""The HTTP server span and the HTTP metrics, as an ASGI wrapper around the whole app."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextvars import ContextVar, Token

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.telemetry.metrics import OTHER, Metrics

# Set in a request's task when the app leaves its answer unfinished on purpose, having logged
# why (an answer cut after it began): its span is failed (`error.type` CUT_SHORT), and the
# server's own error for it is not logged again.
CUT_ON_PURPOSE: ContextVar[bool] = ContextVar("loopwarden_cut_on_purpose", default=False)
CUT_SHORT = "cut_short"
UNTRACED = frozenset({"/metrics", "/healthz", "/readyz"})  # probes and scrapes: no spans
# The app returned without starting a response: the client went away first (nginx's code).
CLIENT_CLOSED = 499
# The methods a label or span names as they are; any other (a client may send any token) is
# `_OTHER`, as OpenTelemetry's HTTP conventions have it, so label values stay bounded.
METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"}
)
_OTHER_METHOD = "_OTHER"


def _method(sent: str) -> str:
    return sent if sent in METHODS else _OTHER_METHOD


class HttpTelemetry:
    def __init__(
        self, app: ASGIApp, metrics: Metrics, tracer: Tracer | None, routes: Sequence[BaseRoute]
    ) -> None:
        """`tracer` None: metrics only (no exporter is configured). The app's `routes` give the
        `route` label; any other path is `other`, so label values stay bounded."""
        self.app = app
        self.metrics = metrics
        self.tracer = tracer
        paths = [(r.path, r.path_regex) for r in routes if isinstance(r, Route)]
        self.exact = frozenset(path for path, _ in paths if "{" not in path)
        self.templated = [(path, regex) for path, regex in paths if "{" in path]

    def route_of(self, path: str) -> str:
        if path in self.exact:
            return path
        for template, regex in self.templated:
            if regex.match(path):
                return template
        return OTHER

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        route, method = self.route_of(scope["path"]), _method(scope["method"])
        status = 0

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        tracer = None if route in UNTRACED else self.tracer
        opened = _start_span(tracer, scope, method, route) if tracer is not None else None
        try:
            await self.app(scope, receive, recording_send)
        except Exception:
            status = status or 500
            raise
        finally:
            status = status or CLIENT_CLOSED  # also when the request task was cancelled
            if opened is not None:
                span, token = opened
                otel_context.detach(token)
                span.set_attribute("http.response.status_code", status)
                cut = CUT_SHORT if CUT_ON_PURPOSE.get() else None
                failure = str(status) if status >= 500 else cut
                if failure:
                    span.set_status(Status(StatusCode.ERROR))
                    span.set_attribute("error.type", failure)
                span.end()
            self._count(route, method, status, started)

    def _count(self, route: str, method: str, status: int, started: float) -> None:
        m, code = self.metrics, str(status)
        m.child(m.http_requests, route, method, code).inc()
        m.child(m.http_duration, route, method, code).observe(time.perf_counter() - started)


def _start_span(
    tracer: Tracer, scope: Scope, method: str, route: str
) -> tuple[Span, Token[Context]]:
    """The SERVER span, under the caller's `traceparent`, made current for the request."""
    carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    parent = propagate.extract(carrier)
    span = tracer.start_span(
        f"{method} {route}",
        parent,
        kind=SpanKind.SERVER,
        attributes={
            "http.request.method": method,
            "http.route": route,
            "url.path": scope["path"],
            "url.scheme": scope.get("scheme", "http"),
        },
    )
    return span, otel_context.attach(trace.set_span_in_context(span, parent))
