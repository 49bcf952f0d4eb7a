"""The `error.type` / `error_type` value of a failure, the same on spans and metrics."""

from __future__ import annotations

from proxy.engine.stop import StopReason
from proxy.engine.values import ToolOutcome
from proxy.errors import ProxyError, UpstreamStatusError


def error_type(error: BaseException) -> str:
    """An upstream's HTTP status, else the error's code (as the client's error body says it),
    else its class: a bug's."""
    if isinstance(error, UpstreamStatusError):
        return str(error.status)
    if isinstance(error, ProxyError) and error.code:
        return error.code
    return type(error).__name__


def cut_short_by(reason: StopReason) -> str:
    """The `error.type` of a model call the run cut short, the run having stopped for `reason`:
    the client gone (`cancelled`), else its time budget (`time_budget`: a final-answer call cut
    by it leaves the run with the stop that called for the answer)."""
    cut = reason if reason in (StopReason.CANCELLED, StopReason.TIME_BUDGET) else None
    return (cut or StopReason.TIME_BUDGET).value


def cut_call_outcome(reason: StopReason) -> ToolOutcome:
    """The outcome of a server call the run's end cut short: `timeout` by its time budget,
    else (the client gone, a failure) `error`."""
    return ToolOutcome.TIMEOUT if reason is StopReason.TIME_BUDGET else ToolOutcome.ERROR
