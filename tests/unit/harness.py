"""Builds an engine run from fakes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from proxy.engine.option_errors import problems
from proxy.engine.options import PolicyOptions
from proxy.engine.policy import Catalog, check_references, compile_policy
from proxy.engine.ports import ConditionChecks, RunStream, ThreadCounters
from proxy.engine.run import Run
from proxy.engine.run_spec import Deps, RunResult, RunSpec
from proxy.engine.values import Prices, ToolSpec
from proxy.errors import PolicyInvalid
from tests.fakes import FakeTools, FixedPrices, ManualClock, RecordingObserver, ScriptedModel


def tool_spec(name: str, *, terminal: bool = False, tool_id: str | None = None) -> ToolSpec:
    definition = {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": {}}},
    }
    return ToolSpec(name, definition, terminal, tool_id)


def named_conditions(options: Any) -> dict[str, str]:
    """Every `webhook` and `python` condition the options name, as configured ones."""
    found: dict[str, str] = {}
    if isinstance(options, list):
        for entry in options:
            found.update(named_conditions(entry))
    elif isinstance(options, dict):
        for key, value in options.items():
            if key in ("webhook", "python"):
                found[value] = key
            else:
                found.update(named_conditions(value))
    return found


def problem(
    options: dict[str, Any], tools: tuple[str, ...] = ("a", "b", "c", "search", "fetch")
) -> tuple[str, str]:
    """The first problem with `options` as an agent's policy over `tools`: (path, message)."""
    specs = {name: tool_spec(name) for name in tools}
    try:
        policy = compile_policy(PolicyOptions.model_validate(options), list(specs), Catalog(specs))
        check_references(policy, (), "m", lambda: False)
    except ValidationError as exc:
        return problems(exc)[0]
    except PolicyInvalid as exc:
        return exc.problems[0]
    raise AssertionError(f"{options} has no problem")


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
        options = PolicyOptions.model_validate(
            {
                "stop_when": stop_when or [],
                "terminating_config": terminating,
                "tool_rules": tool_rules or [],
                "tool_call_limits": tool_call_limits or [],
                "max_steps": max_steps,
                "final_answer": final_answer,
                "parallel_tool_calls": parallel,
            }
        )
        catalog = Catalog(specs, named_conditions(stop_when))
        self.policy = compile_policy(options, list(specs), catalog)
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

    async def run(
        self,
        stream: RunStream | None = None,
        user: str = "hi",
        params: dict[str, Any] | None = None,
        keep: Callable[[RunResult], Awaitable[None]] | None = None,
    ) -> RunResult:
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
            params=params or {},
        )
        self.last_run = Run(spec, self.deps, stream, keep=keep)
        return await self.last_run.execute()
