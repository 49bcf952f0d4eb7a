"""The `error.type` / `error_type` value of a failure, the same on spans and metrics."""

from __future__ import annotations

from proxy.errors import ProxyError, UpstreamStatusError


def error_type(error: BaseException) -> str:
    """An upstream's HTTP status, else the error's code (as the client's error body says it),
    else its class: a bug's."""
    if isinstance(error, UpstreamStatusError):
        return str(error.status)
    if isinstance(error, ProxyError) and error.code:
        return error.code
    return type(error).__name__
