"""The proxy's own headers (SPEC §4.2): the thread a request names, and what an answer says of
its run."""

from __future__ import annotations

from proxy.engine.run_spec import RunResult

THREAD_HEADER = "x-loopwarden-thread-id"
RUN_ID_HEADER = "x-loopwarden-run-id"
STOP_REASON_HEADER = "x-loopwarden-stop-reason"
# openai-python's retry rule (and others') honours it: a run whose tools ran is not replayed.
SHOULD_RETRY_HEADER = "x-should-retry"


def run_headers(run_id: str) -> dict[str, str]:
    """An answer's headers as its run begins."""
    return {RUN_ID_HEADER: run_id}


def with_stop_reason(headers: dict[str, str], result: RunResult) -> None:
    """Adds the run's stop reason to an answer's `headers`."""
    headers[STOP_REASON_HEADER] = result.stop.reason.value


def not_replayed(headers: dict[str, str], result: RunResult) -> None:
    """Asks the client not to send a failed run again when its tools ran (they would run
    twice)."""
    if result.tools_ran:
        headers[SHOULD_RETRY_HEADER] = "false"
