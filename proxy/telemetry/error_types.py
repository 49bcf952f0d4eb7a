"""The `error.type` / `error_type` value of a failure, the same on spans and metrics."""

from __future__ import annotations

from proxy.errors import UpstreamFailure, UpstreamStatusError


def error_type(error: BaseException) -> str:
    if isinstance(error, UpstreamStatusError):
        return str(error.status)
    if isinstance(error, UpstreamFailure):
        return error.code or type(error).__name__
    return type(error).__name__
