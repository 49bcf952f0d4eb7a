"""Builds an engine run from fakes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.engine.policies.stop_conditions import parse_stop_when
from proxy.engine.policies.terminal import parse_terminating_config
from proxy.engine.policies.tool_call_limits import parse_tool_call_limits
from proxy.engine.policies.tool_rules import parse_tool_rules
from proxy.engine.policy import LoopPolicy
from proxy.engine.ports import ConditionChecks, Prices, RunStream, ThreadCounters, ToolSpec
from proxy.engine.run import Deps, Run, RunResult, RunSpec
from tests.fakes import FakeTools, FixedPrices, ManualClock, RecordingObserver, ScriptedModel


def tool_spec(name: str, *, terminal: bool = False, tool_id: str | None = None) -> ToolSpec:
    definition = {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": {}}},
    }
    return ToolSpec(name, definition, terminal, tool_id)


class Harness:
    def __init__(
        self,
        script: list[Any],
        tools: dict[str, Callable[[dict[str, Any]], str]] | None = None,
        *,
        terminal: tuple[str, ...] = (),
        stop_when: list[Any] | None = None,
        terminating: dict[str, Any] | None = None,
        max_steps: int | None = None,
        final_answer: bool = False,
        parallel: bool = False,
        prices: Prices | None = None,
        checks: ConditionChecks | None = None,
        client_tools: list[str] = (),  # type: ignore[assignment]
        max_completion_tokens: int | None = None,
        system_prompt: str | None = None,
        tool_rules: list[Any] | None = None,
        tool_call_limits: list[Any] | None = None,
        threads: ThreadCounters | None = None,
        thread_id: str | None = None,
    ) -> None:
        self.model = ScriptedModel(list(script))
        self.tools = FakeTools(tools or {})
        self.observer = RecordingObserver()
        self.clock = ManualClock()
        specs = {name: tool_spec(name, terminal=name in terminal) for name in self.tools.functions}
        self.policy = LoopPolicy(
            tools=specs,
            stop_when=tuple(parse_stop_when(stop_when or [], "stop_when")),
            max_steps=max_steps,
            terminating=parse_terminating_config(terminating, "terminating_config")
            if terminating
            else None,
            tool_rules=parse_tool_rules(tool_rules or [], "tool_rules"),
            tool_call_limits=parse_tool_call_limits(tool_call_limits or [], "tool_call_limits"),
            final_answer=final_answer,
            parallel_tool_calls=parallel,
        )
        self.deps = Deps(
            self.model,
            self.tools,
            FixedPrices({"m": prices} if prices else {}),
            [self.observer],
            checks,
            self.clock,
            threads,
        )
        self.thread_id = thread_id
        self.client_tools = [
            {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
            for n in client_tools
        ]
        self.max_completion_tokens = max_completion_tokens
        self.system_prompt = system_prompt

    async def run(self, stream: RunStream | None = None, user: str = "hi") -> RunResult:
        spec = RunSpec(
            run_id="run_test",
            model="m",
            messages=[{"role": "user", "content": user}],
            policy=self.policy,
            agent="agent",
            client_tools=self.client_tools,
            max_completion_tokens=self.max_completion_tokens,
            system_prompt=self.system_prompt,
            thread_id=self.thread_id,
        )
        return await Run(spec, self.deps, stream).execute()
