"""How a run ends when its loop raises: one stop reason for each kind of failure (SPEC §5.2)."""

from __future__ import annotations

import logging

from proxy.engine.final_message import Ending
from proxy.engine.stop import Stop, StopReason
from proxy.errors import ClientDisconnected, StateUnavailable, UpstreamFailure

log = logging.getLogger(__name__)


def ending_for(exc: Exception, run_id: str, step: int) -> Ending:
    """The ending of a run whose loop raised `exc` at `step` (cancellation is the caller's: it
    must go on being raised)."""
    if isinstance(exc, ClientDisconnected):
        return Ending(Stop(StopReason.CANCELLED, {"step": step}), {}, None)
    if isinstance(exc, StateUnavailable):
        details = {"error": exc.message, "step": step}
        return Ending(Stop(StopReason.STATE_UNAVAILABLE, details), {}, None)
    if isinstance(exc, UpstreamFailure):
        details = {"error": str(exc), "step": step}
        return Ending(Stop(StopReason.UPSTREAM_ERROR, details), {}, None)
    log.error("run %s failed", run_id, exc_info=exc)
    return Ending(Stop(StopReason.INTERNAL_ERROR, {"step": step}), {}, None)
