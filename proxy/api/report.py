"""The `loop` run report and the bodies built from a run's result (SPEC §4.2, §4.4)."""

from __future__ import annotations

import time
from typing import Any

from starlette.types import Send

from proxy.api.responses import send_bytes, send_error
from proxy.engine.run import RunResult
from proxy.engine.stop import StopReason
from proxy.errors import (
    InternalError,
    LoopFailed,
    ProxyError,
    UpstreamFailure,
    UpstreamStatusError,
    UpstreamUnavailable,
)

# Stops that answer with an error rather than a completion.
_ERRORS = frozenset({StopReason.UPSTREAM_ERROR, StopReason.INTERNAL_ERROR})


def completion_id(run_id: str) -> str:
    """The `id` of a run's completion (and of all its chunks)."""
    return f"chatcmpl-{run_id.removeprefix('run_')}"


def failed(result: RunResult) -> bool:
    return result.stop.is_failure or result.stop.reason in _ERRORS


def loop_report(result: RunResult, include_messages: bool) -> dict[str, Any]:
    report: dict[str, Any] = {
        "run_id": result.run_id,
        "stop_reason": result.stop.reason.value,
        "steps": result.steps,
        "tool_calls": result.tool_calls,
        "cost_usd": round(result.cost_usd, 10) if result.cost_usd is not None else None,
    }
    if result.stop.details:
        report["stop_details"] = result.stop.details
    if include_messages:
        report["messages"] = result.generated
    return report


def completion_body(
    result: RunResult, model: str, report: dict[str, Any], passthrough: bool
) -> dict[str, Any]:
    reply = result.last_reply
    raw = reply.raw if reply is not None and reply.raw is not None else None
    body: dict[str, Any] = dict(raw) if raw else {}
    body.setdefault("id", completion_id(result.run_id))
    body["object"] = "chat.completion"
    body.setdefault("created", int(time.time()))
    body.setdefault("model", model)
    if not (passthrough and raw and result.stop.reason is StopReason.COMPLETED):
        message = dict(result.message)
        message.setdefault("content", None)
        message.setdefault("refusal", None)
        body["choices"] = [
            {
                "index": 0,
                "message": message,
                "finish_reason": result.finish_reason,
                "logprobs": None,
            }
        ]
    body["usage"] = result.usage.to_openai()
    body["loop"] = report
    return body


def failure_error(result: RunResult) -> ProxyError:
    """The error a failed run answers with."""
    stop, error = result.stop, result.error
    if stop.is_failure:
        return LoopFailed(f"the run stopped: {stop.reason.value}", code=stop.error_code)
    if isinstance(error, UpstreamStatusError) and result.tools_ran:
        return UpstreamUnavailable(f"{error.message} after tools ran", code="upstream_error")
    if isinstance(error, UpstreamFailure):
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
