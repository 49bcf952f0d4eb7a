"""`/healthz`, `/readyz` and `/metrics`: what orchestrators and scrapers ask (also served on
`server.probe_port`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from proxy.api.asgi import bearer_token
from proxy.api.route_errors import JSONResponse
from proxy.api.services import Services
from proxy.config import Config
from proxy.errors import StateUnavailable


class Probes:
    """The probe routes of an app whose services are `current()` while its lifespan runs
    (None before), with its metrics in `exposed`."""

    def __init__(
        self, config: Config, current: Callable[[], Services | None], exposed: CollectorRegistry
    ) -> None:
        self.config = config
        self.current = current
        self.exposed = exposed

    async def healthz(self, request: Request) -> Response:
        """The process answers."""
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        """The metrics, with the scrape key when `auth.metrics_key` is set (else open)."""
        if self.config.auth.metrics_key:
            services = self.current()
            if services is None:  # the keys are not read yet
                return JSONResponse({"status": "starting"}, status_code=503)
            services.keys.check_metrics(bearer_token(request.scope))
        return Response(generate_latest(self.exposed), media_type=CONTENT_TYPE_LATEST)

    async def readyz(self, request: Request) -> Response:
        """Ready when the state backend is reachable, still the one opened and takes writes,
        and every required MCP source is connected; not once the server shuts down."""
        services = self.current()
        if services is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        if services.shutdown.begun:  # (the probe port serves on through the drain)
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        try:
            await asyncio.wait_for(services.store.ping(), self.config.state.timeout_s)
        except StateUnavailable as exc:
            return JSONResponse({"status": "unavailable", "detail": exc.message}, status_code=503)
        except Exception as exc:  # any failure of the backend means not ready
            detail = f"state backend unavailable: {type(exc).__name__}"
            return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)
        sources = services.registry.missing()
        if not sources:
            return JSONResponse({"status": "ready"})
        # Ready without optional sources (their tools answer tool errors); not without required.
        missing = [
            {"source": s.name, "required": s.cfg.required, "error": s.error} for s in sources
        ]
        names = ", ".join(s.name for s in sources)
        if any(s.cfg.required for s in sources):
            detail = f"MCP servers not connected: {names}"
            body = {"status": "unavailable", "detail": detail, "mcp_missing": missing}
            return JSONResponse(body, status_code=503)
        detail = f"optional MCP servers not connected: {names}"
        return JSONResponse({"status": "ready", "detail": detail, "mcp_missing": missing})
