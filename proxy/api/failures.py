"""How a failed run answers (SPEC §4.4): an OpenAI-shaped error with the `loop` report, never
retried after side effects. While no tool has run, an upstream's error answer keeps its status
and its own error (scrubbed of secrets when it was read, `proxy.upstream.error_body`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Send

from proxy.api.asgi import send_error
from proxy.api.event_stream import EventStream
from proxy.api.headers import not_replayed, with_stop_reason
from proxy.api.upstream_param import ClientTerms, client_message, client_param
from proxy.engine.final_message import stated_stop
from proxy.engine.run_spec import RunResult
from proxy.errors import (
    InternalError,
    LoopFailed,
    ProxyError,
    ShuttingDown,
    StateUnavailable,
    UpstreamFailure,
    UpstreamStatusError,
    UpstreamUnavailable,
)

# How a route answers a run the end of the server's drain stopped (`Services.execute`).
Failing = Callable[[ShuttingDown, RunResult], Awaitable[None]]
# What a route's failure answer gives of the run besides its report (given too), for the error
# the answer carries.
FailureExtra = Callable[[RunResult, dict[str, Any], ProxyError], dict[str, Any]]


def failed(result: RunResult) -> bool:
    return result.stop.fails_run


def failure_error(result: RunResult, terms: ClientTerms | None = None) -> ProxyError:
    """The error a failed run answers with; an upstream's relayed with its `param` in the
    client's `terms` (`upstream_param`)."""
    stop, error = result.stop, result.error
    if stop.is_policy_failure:
        said = stated_stop(stop).removeprefix("Stopped: ").rstrip(".")
        return LoopFailed(f"the run stopped ({stop.reason.value}): {said}", code=stop.error_code)
    if isinstance(error, UpstreamStatusError) and result.tools_ran:
        return UpstreamUnavailable(f"{error} after tools ran", code="upstream_error")
    if isinstance(error, UpstreamStatusError) and error.param is not None:
        return _in_client_terms(error, client_param(error.param, result.last_request, terms))
    if isinstance(error, UpstreamFailure | StateUnavailable):
        return error
    return InternalError()


def _in_client_terms(error: UpstreamStatusError, param: str | None) -> UpstreamStatusError:
    if param == error.param:
        return error
    message = error.message
    if error.param is not None:  # "Invalid 'messages[2].content': …"
        message = client_message(message, error.param, param)
    return UpstreamStatusError(
        error.status,
        message,
        error_type=error.type,
        param=param,
        code=error.code,
        retry_headers=error.retry_headers,
    )


async def send_failure(
    send: Send,
    result: RunResult,
    report: dict[str, Any],
    headers: dict[str, str],
    terms: ClientTerms | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """A failed run's response: its error (`failure_error`) with the `loop` report (and
    `extra`, what the route's answer also gives of it), and the upstream's retry headers when
    its error answer is relayed."""
    not_replayed(headers, result)
    error = failure_error(result, terms)
    if isinstance(error, UpstreamStatusError) and error.retry_headers:
        headers = {**error.retry_headers, **headers}
    await send_error(send, error, headers, {**(extra or {}), "loop": report})


def drain_end_answer(
    send: Send,
    headers: dict[str, str],
    report: Callable[[RunResult], dict[str, Any]],
    extra: FailureExtra | None = None,
) -> Failing:
    """How a run the end of the server's drain stopped is answered before any of it was sent:
    the error (503 `shutting_down`, not to be sent again once tools ran) with the `loop`
    report (and `extra` of the run)."""

    async def answer(error: ShuttingDown, result: RunResult) -> None:
        with_stop_reason(headers, result)
        reported = report(result)
        given = extra(result, reported, error) if extra is not None else {}
        await send_error(send, error, {**headers, **error.headers}, {**given, "loop": reported})

    return answer


def stream_drain_end(
    writer: EventStream,
    event: Failing,
    report: Callable[[RunResult], dict[str, Any]],
    extra: FailureExtra | None = None,
) -> Failing:
    """`drain_end_answer` for a stream: one that began ends with `event`'s failure event."""
    unstarted = drain_end_answer(writer.send, writer.headers, report, extra)

    async def answer(error: ShuttingDown, result: RunResult) -> None:
        await (event if writer.started else unstarted)(error, result)

    return answer
