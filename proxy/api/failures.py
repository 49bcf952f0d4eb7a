"""How a failed run answers (SPEC §4.4): the upstream's own error while no tool has run,
else an OpenAI-shaped error with the `loop` report, never retried after side effects."""

from __future__ import annotations

from typing import Any

from starlette.types import Send

from proxy.api.asgi import send_bytes, send_error
from proxy.engine.run_spec import RunResult
from proxy.engine.stop import ERROR_STOPS
from proxy.errors import (
    InternalError,
    LoopFailed,
    ProxyError,
    StateUnavailable,
    UpstreamFailure,
    UpstreamStatusError,
    UpstreamUnavailable,
)


def failed(result: RunResult) -> bool:
    return result.stop.is_failure or result.stop.reason in ERROR_STOPS


def failure_error(result: RunResult) -> ProxyError:
    """The error a failed run answers with."""
    stop, error = result.stop, result.error
    if stop.is_failure:
        return LoopFailed(f"the run stopped: {stop.reason.value}", code=stop.error_code)
    if isinstance(error, UpstreamStatusError) and result.tools_ran:
        return UpstreamUnavailable(f"{error.message} after tools ran", code="upstream_error")
    if isinstance(error, UpstreamFailure | StateUnavailable):
        return error
    return InternalError()


async def send_failure(
    send: Send, result: RunResult, report: dict[str, Any], headers: dict[str, str]
) -> None:
    """A failed run's response: the upstream's own error while no tool has run, else ours."""
    if result.tools_ran:
        headers["x-should-retry"] = "false"
    error = result.error
    if isinstance(error, UpstreamStatusError) and not result.tools_ran:
        content_type = (error.content_type or "application/json").encode("latin-1")
        await send_bytes(send, error.status, error.content, content_type, headers)
        return
    await send_error(send, failure_error(result), headers, {"loop": report})
