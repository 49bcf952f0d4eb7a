"""Terminal tools and terminating config (SPEC §7): which tool calls end a run, and nudges."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from proxy.engine.options import DEFAULT_NUDGE, TerminatingOptions
from proxy.engine.policies.base import Block, Nudge, Policy, StepPlan
from proxy.engine.state import RunState
from proxy.engine.stop import Stop, StopReason, limit_details
from proxy.engine.values import ModelReply, ToolCall, ToolOutcome, ToolResult


@dataclass(frozen=True, slots=True)
class TerminatingConfig:
    tool_ids: tuple[str, ...]
    consecutive_nudges: int = 1
    nudge_message: str = DEFAULT_NUDGE
    max_invocations: int = 64
    path: str = "terminating_config"
    # Where a number was given when not at `path`: an agent's, a request's looser one tightened
    # to it (`tighten`).
    given_at: tuple[tuple[str, str], ...] = ()

    def path_of(self, name: str) -> str:
        """The config path of the number `name` as it holds."""
        return f"{dict(self.given_at).get(name, self.path)}.{name}"

    @classmethod
    def of(cls, options: TerminatingOptions, path: str) -> TerminatingConfig:
        return cls(
            tuple(options.tool_ids),
            options.consecutive_nudges,
            options.nudge_message,
            options.max_invocations,
            path,
        )


def terminal_hint(names: Iterable[str]) -> str:
    """What the model is told about terminal tools (SPEC §7.1)."""
    listed = ", ".join(f"`{name}`" for name in sorted(names))
    return f"Calling {listed} ends your turn; its output is your reply."


class TerminalTools(Policy):
    """`terminal: true` tools, plus the tools and nudges of a terminating config."""

    def __init__(self, terminal: Iterable[str], config: TerminatingConfig | None) -> None:
        self.terminal = frozenset(terminal)
        self.config = config
        self.nudges = 0
        self._failed_at_step = -1

    def before_step(self, run: RunState, plan: StepPlan) -> Stop | None:
        if self.config is not None and run.invocations >= self.config.max_invocations:
            details = limit_details(
                self.config.path_of("max_invocations"),
                "max_invocations",
                run.step_count,
                threshold=self.config.max_invocations,
                observed=run.invocations,
            )
            return Stop(StopReason.MAX_INVOCATIONS, details, "max_invocations_exceeded")
        return None

    def allows_final(self, run: RunState, plan: StepPlan) -> bool:
        return self.config is None or run.invocations < self.config.max_invocations

    def after_reply(self, run: RunState, plan: StepPlan, reply: ModelReply) -> Stop | None:
        if reply.tool_calls:  # any tool call resets the nudge counter, even to an unknown tool
            self.nudges = 0
        return None

    async def review_call(self, run: RunState, call: ToolCall) -> Block | None:
        if call.name in self.terminal and self._failed_at_step == run.step_count:
            return Block(
                f"Not executed: a terminating tool already failed in this reply. "
                f"Fix the error, then call '{call.name}' again.",
                outcome=ToolOutcome.ERROR,
            )
        return None

    def after_tool(self, run: RunState, call: ToolCall, result: ToolResult) -> Stop | None:
        if call.name not in self.terminal:
            return None
        if result.is_error:
            self._failed_at_step = run.step_count
            return None
        return Stop(StopReason.TERMINAL_TOOL, {"tool": call.name, "step": run.step_count})

    def after_reply_without_tools(self, run: RunState, reply: ModelReply) -> Nudge | Stop | None:
        if self.config is None:
            return None
        self.nudges += 1
        if self.nudges <= self.config.consecutive_nudges:
            return Nudge(self.config.nudge_message)
        details = limit_details(
            self.config.path_of("consecutive_nudges"),
            "consecutive_nudges",
            run.step_count,
            threshold=self.config.consecutive_nudges,
            observed=self.nudges,
        )
        return Stop(StopReason.NUDGES_EXHAUSTED, details, "max_consecutive_nudges_exceeded")
