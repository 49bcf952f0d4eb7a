"""Terminal tools and terminating config (SPEC §7): which tool calls end a run, and nudges."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from proxy.engine.fields import int_at_least, known_object
from proxy.engine.policies.base import Block, Nudge, Policy, StepPlan
from proxy.engine.ports import ModelReply, ToolCall, ToolResult
from proxy.engine.state import RunState
from proxy.engine.stop import Stop, StopReason
from proxy.errors import SpecError

DEFAULT_NUDGE = (
    "You are currently in an autonomous execution mode with no user interaction. "
    "You must complete your task by calling one of the terminating tools."
)


@dataclass(frozen=True, slots=True)
class TerminatingConfig:
    tool_ids: tuple[str, ...]
    consecutive_nudges: int = 1
    nudge_message: str = DEFAULT_NUDGE
    max_invocations: int = 64


_FIELDS = ("tool_ids", "consecutive_nudges", "nudge_message", "max_invocations")


def parse_terminating_config(raw: Any, path: str) -> TerminatingConfig:
    raw = known_object(raw, path, _FIELDS)
    ids = raw.get("tool_ids")
    if not isinstance(ids, list) or not ids:
        raise SpecError("must be a non-empty list of tool names or ids", param=f"{path}.tool_ids")
    for i, tool in enumerate(ids):
        if not isinstance(tool, str) or not tool:
            raise SpecError("must be a tool name or id", param=f"{path}.tool_ids[{i}]")
    nudges = int_at_least(raw.get("consecutive_nudges", 1), f"{path}.consecutive_nudges", 0)
    message = raw.get("nudge_message", DEFAULT_NUDGE)
    if not isinstance(message, str) or not message.strip():
        raise SpecError("must be a non-empty string", param=f"{path}.nudge_message")
    invocations = int_at_least(raw.get("max_invocations", 64), f"{path}.max_invocations")
    return TerminatingConfig(tuple(ids), nudges, message, invocations)


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
            details = {
                "condition": "terminating_config.max_invocations",
                "kind": "max_invocations",
                "threshold": self.config.max_invocations,
                "observed": run.invocations,
                "step": run.step_count,
            }
            return Stop(StopReason.MAX_INVOCATIONS, details, "max_invocations_exceeded")
        return None

    async def review_call(self, run: RunState, call: ToolCall) -> Block | None:
        self.nudges = 0  # any tool call resets the nudge counter
        if call.name in self.terminal and self._failed_at_step == run.step_count:
            return Block(
                f"Not executed: a terminating tool already failed in this reply. "
                f"Fix the error, then call '{call.name}' again.",
                outcome="error",
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
        details = {
            "condition": "terminating_config.consecutive_nudges",
            "kind": "consecutive_nudges",
            "threshold": self.config.consecutive_nudges,
            "observed": self.nudges,
            "step": run.step_count,
        }
        return Stop(StopReason.NUDGES_EXHAUSTED, details, "max_consecutive_nudges_exceeded")
