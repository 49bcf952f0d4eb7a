"""A run's policy: the loop rules resolved from the agent and the request's `loop` object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.engine.policies.base import Policy
from proxy.engine.policies.budgets import Budgets
from proxy.engine.policies.stop_conditions import Condition, StopConditions
from proxy.engine.policies.terminal import TerminalTools, TerminatingConfig
from proxy.engine.policies.tool_call_limits import ToolCallLimit, ToolCallLimits
from proxy.engine.policies.tool_rules import RuleBook, ToolRule, ToolRules
from proxy.engine.ports import ConditionChecks, Prices, ThreadCounters, ToolSpec

DEFAULT_MAX_STEPS = 25


@dataclass(frozen=True, slots=True)
class LoopPolicy:
    tools: Mapping[str, ToolSpec] = field(default_factory=dict)
    stop_when: tuple[Condition, ...] = ()
    max_steps: int | None = None
    terminating: TerminatingConfig | None = None
    tool_rules: tuple[ToolRule, ...] = ()
    tool_call_limits: tuple[ToolCallLimit, ...] = ()
    final_answer: bool = False
    parallel_tool_calls: bool = False

    @property
    def terminal_tools(self) -> frozenset[str]:
        names = {name for name, spec in self.tools.items() if spec.terminal}
        if self.terminating is not None:
            names.update(self.terminating.tool_ids)
        names.update(RuleBook(self.tool_rules).exit_tools)
        return frozenset(names)

    def effective_max_steps(self) -> int | None:
        if self.max_steps is not None:
            return self.max_steps
        return DEFAULT_MAX_STEPS if self.tools else None

    def build(
        self,
        prices: Prices | None,
        checks: ConditionChecks | None,
        threads: ThreadCounters | None = None,
    ) -> list[Policy]:
        """Fresh, per-run policy objects, in checkpoint order."""
        policies: list[Policy] = [TerminalTools(self.terminal_tools, self.terminating)]
        if self.tool_rules:
            policies.append(ToolRules(RuleBook(self.tool_rules)))
        policies.append(StopConditions(self.stop_when, self.effective_max_steps(), checks))
        if self.tool_call_limits:
            # The last reviewer: its review reserves thread counts, so nothing may block after it.
            policies.append(ToolCallLimits(self.tool_call_limits, threads))
        policies.append(Budgets(self.stop_when, prices))  # last: it sizes the request
        return policies
