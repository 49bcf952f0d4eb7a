"""The checkpoints every loop policy may implement; `proxy.engine.checkpoints` says how their
answers combine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.engine.state import RunState
from proxy.engine.stop import Stop
from proxy.engine.values import ModelReply, ToolCall, ToolOutcome, ToolResult


@dataclass(slots=True)
class StepPlan:
    """What the next upstream call will offer; policies narrow it in `before_step`."""

    tools: list[dict[str, Any]]
    tool_choice: Any = None
    max_completion_tokens: int | None = None
    extra_messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Block:
    """A call that is not executed; the model reads `message` as the tool's result."""

    message: str
    outcome: ToolOutcome = ToolOutcome.BLOCKED_RULE
    stop: Stop | None = None  # a block that also ends the run


@dataclass(frozen=True, slots=True)
class Nudge:
    """A reply without tool calls that may not end the run: `message` is added for the model,
    and the run goes on."""

    message: str


class Policy:
    """No-op checkpoints; a policy overrides the ones it needs."""

    def before_step(self, run: RunState, plan: StepPlan) -> Stop | None:
        """Before a step: narrow what it offers (tools, `tool_choice`, messages), or stop
        before spending."""
        return None

    def size_step(self, run: RunState, plan: StepPlan) -> Stop | None:
        """The plan is final: cap what the step may spend, or stop before it."""
        return None

    def allows_final(self, run: RunState, plan: StepPlan) -> bool:
        """Whether the run, stopped by a limit, may make the one tool-free call for its answer
        (`final_answer: true`); what that call may spend is capped as a step's is."""
        return self.size_step(run, plan) is None

    def after_reply(self, run: RunState, plan: StepPlan, reply: ModelReply) -> Stop | None:
        """The step's reply came (its usage counted): stop before its calls are looked at."""
        return None

    async def review_call(self, run: RunState, call: ToolCall) -> Block | None:
        """The rules' review of one call, in its reply's order: allow it (None) or block it
        with the message the model reads."""
        return None

    async def reserve(self, run: RunState, call: ToolCall) -> Block | None:
        """Every review passed: take shared counters for the call, or block it."""
        return None

    def admit(self, run: RunState, call: ToolCall) -> None:
        """The call passed every review and will be executed."""

    async def unreserve(self, run: RunState, calls: Sequence[ToolCall]) -> None:
        """Admitted calls never ran (the run ended first): give back what `reserve` took."""

    def decides_next(self, call: ToolCall) -> bool:
        """Whether the review of the calls after `call` needs its result: it then runs before
        them, alone, however the run's calls run."""
        return False

    def after_tool(self, run: RunState, call: ToolCall, result: ToolResult) -> Stop | None:
        """A call ran: stop on its result (a terminal tool that succeeded)."""
        return None

    def after_reply_without_tools(self, run: RunState, reply: ModelReply) -> Nudge | Stop | None:
        """A reply without tool calls, which would end the run: let it (None), nudge the model
        to go on, or stop with a reason of the policy's own."""
        return None

    async def after_step(self, run: RunState) -> Stop | None:
        """A step that would go on has ended (its calls ran): stop conditions and budgets."""
        return None
