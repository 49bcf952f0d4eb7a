"""Fakes that implement the engine's ports, for tests that need no sockets."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.engine.events import RunEvent
from proxy.engine.usage import Usage
from proxy.engine.values import (
    DeltaSink,
    ModelReply,
    ModelRequest,
    Prices,
    ToolCall,
    ToolContext,
    ToolOutcome,
    ToolResult,
)

_ids = itertools.count(1)


def reply(
    text: str | None = None,
    calls: list[tuple[str, str]] | None = None,
    *,
    prompt: int = 10,
    completion: int = 5,
    finish: str | None = None,
    cost: float | None = None,
) -> ModelReply:
    """A scripted model reply: text and/or (name, arguments JSON) tool calls."""
    tool_calls = [ToolCall(f"call_{next(_ids)}", name, args) for name, args in calls or []]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = [c.to_openai() for c in tool_calls]
    return ModelReply(
        message=message,
        tool_calls=tool_calls,
        finish_reason=finish or ("tool_calls" if tool_calls else "stop"),
        usage=Usage(prompt, completion, prompt + completion),
        reported_cost_usd=cost,
        response_id="resp-1",
        response_model="fake-model",
    )


@dataclass
class ScriptedModel:
    """Replies in order; a callable entry computes its reply from the request."""

    script: list[ModelReply | Callable[[ModelRequest], ModelReply]]
    requests: list[ModelRequest] = field(default_factory=list)

    async def complete(
        self, request: ModelRequest, on_delta: DeltaSink | None, *, deadline: float | None = None
    ) -> ModelReply:
        self.requests.append(request)
        if not self.script:
            raise AssertionError("the model was called more often than scripted")
        entry = self.script.pop(0)
        result = entry(request) if callable(entry) else entry
        if on_delta is not None:  # as an upstream's stream begins, whether or not it has text
            await on_delta.begin({}, result.text)
        return result


@dataclass
class FakeTools:
    """Tool name -> function of the parsed arguments; a raised exception is a tool error."""

    functions: Mapping[str, Callable[[dict[str, Any]], str]]
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def check(self, call: ToolCall) -> dict[str, Any] | str:
        import json

        if call.name not in self.functions:
            return f"unknown tool {call.name!r}"
        return dict(json.loads(call.arguments or "{}"))

    async def execute(
        self, call: ToolCall, ctx: ToolContext, arguments: dict[str, Any] | None = None
    ) -> ToolResult:
        import json

        args = arguments if arguments is not None else json.loads(call.arguments or "{}")
        self.calls.append((call.name, args))
        try:
            return ToolResult(self.functions[call.name](args))
        except Exception as exc:
            return ToolResult(str(exc), ToolOutcome.ERROR)


@dataclass
class FixedPrices:
    table: Mapping[str, Prices] = field(default_factory=dict)

    def prices(self, model: str) -> Prices | None:
        return self.table.get(model)

    def cost(self, model: str, usage: Usage) -> float | None:
        p = self.table.get(model)
        if p is None:
            return None
        return usage.prompt_tokens * p.input + usage.completion_tokens * p.output


@dataclass
class RecordingObserver:
    events: list[RunEvent] = field(default_factory=list)

    def on_event(self, event: RunEvent) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


@dataclass
class FakeChecks:
    answers: Mapping[str, bool | None]  # None: the check fails
    seen: list[Mapping[str, Any]] = field(default_factory=list)

    async def check(self, kind: str, name: str, snapshot: Mapping[str, Any]) -> bool | None:
        self.seen.append(snapshot)
        return self.answers[name]


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
