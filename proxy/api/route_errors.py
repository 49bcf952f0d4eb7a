"""Errors of the routes behind starlette's router (the probes, stored records, relayed routes),
rendered as the `ErrorBoundary` renders the raw routes': OpenAI-shaped JSON."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import InternalError, MethodNotAllowed, NotFound, ProxyError


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(error: ProxyError) -> Response:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)


async def proxy_error(request: Request, exc: Exception) -> Response:
    return error_response(exc if isinstance(exc, ProxyError) else InternalError())


async def internal_error(request: Request, exc: Exception) -> Response:
    return error_response(InternalError())


async def not_found(request: Request, exc: Exception) -> Response:
    """404 for a path no route serves, 405 for a method the route does not take."""
    if isinstance(exc, HTTPException) and exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path[:300]}"
        return error_response(MethodNotAllowed(message))
    return error_response(NotFound(f"no route {request.method} {request.url.path[:300]}"))


# Starlette's exception handlers for them: every error one route lets escape.
EXCEPTION_HANDLERS: dict[Any, Any] = {
    404: not_found,
    405: not_found,
    ProxyError: proxy_error,
    Exception: internal_error,
}
