"""The live state of one run: its conversation, its steps and its running totals."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from proxy.engine.expressions.vocabulary import VARIABLES
from proxy.engine.usage import Usage
from proxy.engine.values import PART_BREAK, ModelReply, ModelRequest, ToolCall


@dataclass(slots=True)
class StepRecord:
    index: int
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_results: list[dict[str, Any]] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    cost_usd: float | None = None
    finish_reason: str | None = None
    text: str = ""

    def snapshot(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in self.tool_calls],
            "tool_results": list(self.tool_results),
            "usage": _counts(self.usage),
            "cost_usd": self.cost_usd if self.cost_usd is not None else 0.0,
            "finish_reason": self.finish_reason or "",
            "text": self.text,
        }


@dataclass(slots=True)
class RunState:
    run_id: str
    model: str
    started_at: float
    messages: list[dict[str, Any]]
    thread_id: str | None = None
    now: float = 0.0  # the clock's last reading, for time-based conditions
    generated: list[dict[str, Any]] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    cost_usd: float | None = None
    invocations: int = 0
    tool_calls: int = 0
    tools_ran: bool = False
    # The tools a tool call limit blocked in this run: their calls are blocked from then on
    # (counts only grow), so no rule forces them or holds the run's end for them.
    limited: set[str] = field(default_factory=set)
    upstream_s: float = 0.0
    tools_s: float = 0.0  # the time some tool ran (calls run together count their span once)
    tools_running: int = 0
    tools_since: float = 0.0
    # The server calls of a reply that also called client tools, kept for the client's next
    # request (SPEC §5.1.6).
    held: dict[str, Any] | None = None
    last_reply: ModelReply | None = None  # the model's latest reply, for the run's answer
    last_request: ModelRequest | None = None  # the latest call's, for its error's `param`
    one_document: bool = False  # the reply is one JSON document (`RunSpec.one_document`)

    @property
    def step_count(self) -> int:
        return len(self.steps)

    @property
    def elapsed_s(self) -> float:
        return max(0.0, self.now - self.started_at)

    @property
    def text(self) -> str:
        """The text of every step, in order, separated by a blank line (SPEC §5.3); with
        `one_document`, the last step's that has text."""
        if self.one_document:
            return next((step.text for step in reversed(self.steps) if step.text), "")
        return PART_BREAK.join(step.text for step in self.steps if step.text)

    @property
    def tool_time_s(self) -> float:
        """The time some tool ran, through `now`: calls still running count to then (a run cut
        short ends before the calls it cancelled have let go)."""
        running = self.now - self.tools_since if self.tools_running else 0.0
        return self.tools_s + max(0.0, running)

    def tool_began(self, now: float) -> None:
        if self.tools_running == 0:
            self.tools_since = now
        self.tools_running += 1

    def tool_ended(self, now: float) -> None:
        """A call began with `tool_began` ended (however: cut short too)."""
        self.tools_running -= 1
        if self.tools_running == 0:
            self.tools_s += now - self.tools_since

    def called_tools(self) -> set[str]:
        """The tools whose calls ran (SPEC §9: a blocked call did not)."""
        return {result["name"] for step in self.steps for result in step.tool_results}

    def add_cost(self, cost: float | None) -> None:
        if cost is not None:
            self.cost_usd = (self.cost_usd or 0.0) + cost

    def append(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self.generated.append(message)

    def snapshot(self, names: Container[str] = VARIABLES) -> dict[str, Any]:
        """The variables a custom condition sees (SPEC §6 `expr`), or those of them it `names`."""
        values: dict[str, Any] = {}
        if "steps" in names:
            values["steps"] = [step.snapshot() for step in self.steps]
        if "usage" in names:
            values["usage"] = _counts(self.usage)
        if "cost_usd" in names:
            values["cost_usd"] = self.cost_usd or 0.0
        if "elapsed_s" in names:
            values["elapsed_s"] = self.elapsed_s
        return values


def _counts(usage: Usage) -> dict[str, int]:
    """A usage as a condition sees it: its three token counts, no details."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
