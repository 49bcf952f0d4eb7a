"""What a run emits as it goes; telemetry observes these and nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.engine.state import RunState
from proxy.engine.stop import Stop
from proxy.engine.usage import Usage
from proxy.engine.values import ModelReply, ModelRequest, ToolCall, ToolOutcome, ToolResult


@dataclass(frozen=True, slots=True)
class RunStarted:
    run_id: str
    agent: str | None
    model: str
    thread_id: str | None
    at: float


@dataclass(frozen=True, slots=True)
class StepStarted:
    run_id: str
    step: int
    request: ModelRequest
    at: float


@dataclass(frozen=True, slots=True)
class ModelReplied:
    run_id: str
    step: int
    reply: ModelReply
    cost_usd: float | None
    duration_s: float


@dataclass(frozen=True, slots=True)
class ModelFailed:
    run_id: str
    step: int
    error: BaseException
    duration_s: float


@dataclass(frozen=True, slots=True)
class ToolStarted:
    run_id: str
    step: int
    call: ToolCall


@dataclass(frozen=True, slots=True)
class ToolExecuted:
    run_id: str
    step: int
    call: ToolCall
    result: ToolResult  # what the model reads
    duration_s: float
    # How the call itself ended, where the model reads otherwise (an output the run's bound
    # left out): what telemetry counts, the tool's health.
    ended: ToolOutcome | None = None

    @property
    def outcome(self) -> ToolOutcome:
        return self.ended or self.result.outcome


@dataclass(frozen=True, slots=True)
class CallBlocked:
    run_id: str
    step: int
    call: ToolCall
    outcome: ToolOutcome  # BLOCKED_RULE or BLOCKED_LIMIT
    message: str


@dataclass(frozen=True, slots=True)
class Nudged:
    run_id: str
    step: int
    message: str


@dataclass(frozen=True, slots=True)
class ConditionHeld:
    run_id: str
    step: int
    details: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ConditionFailed:
    """A stop condition could not be evaluated (it did not hold)."""

    run_id: str
    step: int
    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class RunFinished:
    run_id: str
    agent: str | None
    model: str
    stop: Stop
    steps: int
    tool_calls: int
    usage: Usage
    cost_usd: float | None
    duration_s: float
    upstream_s: float
    tools_s: float
    error: BaseException | None = field(default=None)

    @classmethod
    def of(
        cls, run: RunState, agent: str | None, stop: Stop, error: BaseException | None
    ) -> RunFinished:
        return cls(
            run.run_id,
            agent,
            run.model,
            stop,
            run.step_count,
            run.tool_calls,
            run.usage,
            run.cost_usd,
            run.elapsed_s,
            run.upstream_s,
            run.tool_time_s,
            error,
        )


RunEvent = (
    RunStarted
    | StepStarted
    | ModelReplied
    | ModelFailed
    | ToolStarted
    | ToolExecuted
    | CallBlocked
    | Nudged
    | ConditionHeld
    | ConditionFailed
    | RunFinished
)
