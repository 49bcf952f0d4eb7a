"""Stop reasons: the closed set of SPEC §5.2 with two more (`condition_error`: an `expr` that
would cost too much to evaluate; `state_unavailable`: the state backend failed mid-run), and the
value a policy returns to end a run."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class StopReason(StrEnum):
    """Why a run ended: one of these on every surface (headers, `loop`, spans, metrics)."""

    COMPLETED = "completed"
    TERMINAL_TOOL = "terminal_tool"
    CLIENT_TOOL_CALL = "client_tool_call"
    TOOL_CALLED = "tool_called"
    MAX_STEPS = "max_steps"
    TOKEN_BUDGET = "token_budget"
    COST_BUDGET = "cost_budget"
    TIME_BUDGET = "time_budget"
    FINISH_REASON = "finish_reason"
    CUSTOM_CONDITION = "custom_condition"
    CONDITION_ERROR = "condition_error"
    TOOL_CALL_LIMIT = "tool_call_limit"
    MAX_INVOCATIONS = "max_invocations"
    NUDGES_EXHAUSTED = "nudges_exhausted"
    CONTENT_FILTER = "content_filter"
    UPSTREAM_ERROR = "upstream_error"
    STATE_UNAVAILABLE = "state_unavailable"
    CANCELLED = "cancelled"
    INTERNAL_ERROR = "internal_error"


# Stops imposed by a limit rather than by the model: their final message is the last assistant
# text, or a final answer when the policy asks for one (SPEC §5.3).
LIMIT_STOPS = frozenset(
    {
        StopReason.MAX_STEPS,
        StopReason.TOKEN_BUDGET,
        StopReason.COST_BUDGET,
        StopReason.TIME_BUDGET,
        StopReason.TOOL_CALLED,
        StopReason.CUSTOM_CONDITION,
        StopReason.CONDITION_ERROR,
        StopReason.TOOL_CALL_LIMIT,
    }
)

# Stops that answer with an error rather than a completion (and mark the run span an error).
ERROR_STOPS = frozenset(
    {StopReason.UPSTREAM_ERROR, StopReason.STATE_UNAVAILABLE, StopReason.INTERNAL_ERROR}
)

# finish_reason reported to the client for stops that do not keep the upstream's.
FINISH_REASONS: dict[StopReason, str] = {
    StopReason.TERMINAL_TOOL: "stop",
    StopReason.CLIENT_TOOL_CALL: "tool_calls",
    StopReason.TOOL_CALLED: "stop",
    StopReason.MAX_STEPS: "length",
    StopReason.TOKEN_BUDGET: "length",
    StopReason.COST_BUDGET: "length",
    StopReason.TIME_BUDGET: "length",
    StopReason.CUSTOM_CONDITION: "stop",
    StopReason.CONDITION_ERROR: "stop",
    StopReason.TOOL_CALL_LIMIT: "stop",
}


_UNSET: Any = object()


def limit_details(
    condition: str,
    kind: str,
    step: int,
    *,
    threshold: Any = _UNSET,
    observed: Any = _UNSET,
    **more: Any,
) -> dict[str, Any]:
    """The `stop_details` of a stop that a condition or limit made: the condition (its path in
    the policy), its kind, its threshold and what was observed (when it has them), the step,
    then what else the stop tells (an `id`, a tool, a message; those None are left out)."""
    details: dict[str, Any] = {"condition": condition, "kind": kind}
    if threshold is not _UNSET:
        details["threshold"] = threshold
    if observed is not _UNSET:
        details["observed"] = observed
    details["step"] = step
    details.update((name, value) for name, value in more.items() if value is not None)
    return details


@dataclass(frozen=True, slots=True)
class Stop:
    """Ends a run. `error_code` marks a stop that fails the run (HTTP 422, SPEC §4.4)."""

    reason: StopReason
    details: dict[str, Any] = field(default_factory=dict)
    error_code: str | None = None

    @property
    def is_policy_failure(self) -> bool:
        """A policy failed the run (a loop error, 422)."""
        return self.error_code is not None

    @property
    def fails_run(self) -> bool:
        """The run answers with an error, not a completion: a policy failed it, or the
        upstream, the state backend or the proxy did (ERROR_STOPS)."""
        return self.is_policy_failure or self.reason in ERROR_STOPS
